"""scripts/ncu_table.py: one line per kernel from Nsight Compute's raw CSV page (its header line, its units
line, then a line per profiled kernel), the columns it knows picked by name wherever they sit."""

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "ncu_table.py"


def test_the_known_columns_of_each_kernel_are_printed_with_their_units(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("ncu_table", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    report = tmp_path / "r.csv"
    report.write_text('"ID","Kernel Name","Other","gpu__time_duration.sum","launch__registers_per_thread"\n'
                      '"","","","us","register/thread"\n'
                      '"0","_rpa_kernel","x","259.20","116"\n'
                      '"1","ragged_paged_attention_mgpu_mosaic_gpu_kernel","y","183.01","223"\n')
    script.main(str(report))
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["kernel | us (us) | regs (register/thread)",
                     "_rpa_kernel | 259.20 | 116",
                     "ragged_paged_attention_mgpu_mosaic_gpu_kernel | 183.01 | 223"]
