"""Find a model, build it, and fill its parameters.

`model` may be a preset name (`qwen3-0.6b`: config only, for `load_format="dummy"`), `demo`
(the small trained model shipped in checkpoints/), or a directory holding a Hugging Face
checkpoint (config.json + *.safetensors, sharded or not) or one written by `mrv2-jax convert`
(config.json + an orbax `params/` folder).
"""

import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from mrv2_jax.models.decoder import CONSTANT_INITS, CausalLM, init_kind, init_of_kind, random_init_scale
from mrv2_jax.models.model_state import ModelState, WeightSource, model_state_for
from mrv2_jax.models.paths import CHECKPOINTS_DIR, DEFAULT_MODEL, resolve_model_path  # noqa: F401 (re-exported)
from mrv2_jax.transformers_lock import TRANSFORMERS_LOCK

LOAD_FORMATS = ("auto", "safetensors", "orbax", "dummy")
DTYPES = {"bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16, "float32": jnp.float32,
          "f32": jnp.float32, "float16": jnp.float16}


def load_hf_config(path: Path):
    with TRANSFORMERS_LOCK:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(str(path))


def resolve_dtype(dtype) -> jnp.dtype:
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        return DTYPES[dtype]
    return jnp.dtype(dtype)


def init_model(hf_config, dtype=jnp.float32, seed: int = 0, layer_unroll: int | bool = 1) -> CausalLM:
    """A randomly initialised model for `hf_config` (training, dummy weights)."""
    state = model_state_for(hf_config)
    return CausalLM(state, dtype=resolve_dtype(dtype), rngs=nnx.Rngs(seed), layer_unroll=layer_unroll)


def load_model(model=None, dtype="bfloat16", load_format: str = "auto", seed: int = 0,
               layer_unroll: int | bool = 1, hf_config=None) -> tuple[ModelState, CausalLM, Path]:
    """Build the model and load its weights. Returns (model_state, model, model_dir).
    `hf_config`: the model's config when the caller has read it already."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    path = resolve_model_path(model)
    dtype = resolve_dtype(dtype)
    if hf_config is None:
        hf_config = load_hf_config(path)
    if load_format == "auto":
        load_format = "orbax" if (path / "params").is_dir() else "safetensors"
    if load_format == "dummy":
        lm = nnx.eval_shape(lambda: init_model(hf_config, dtype, seed, layer_unroll))
        init_dummy(lm, seed)
        return lm.spec, lm, path
    lm = nnx.eval_shape(lambda: init_model(hf_config, dtype, seed, layer_unroll))
    if load_format == "orbax":
        from mrv2_jax.models.checkpoint import restore_params

        restore_params(lm, path / "params")
    else:
        load_safetensors(lm, path)
    return lm.spec, lm, path


def init_dummy(lm: CausalLM, seed: int = 0) -> None:
    """Fill `lm` (abstract or concrete) with random weights made on the device, one parameter
    per jitted call: fast even for 100B models, and the peak memory is the weights plus one
    parameter's temporaries (one jit over the whole model may keep tens of GB of random-number
    temporaries alive next to its outputs, too many for a 110 GB model on a 141 GB GPU).
    On a CPU backend numpy draws them instead: there the models are small, and each parameter
    shape would otherwise compile an XLA program of its own."""
    make = _host_dummy_param if jax.default_backend() == "cpu" else _dummy_param
    params = [(p, node) for p, node in nnx.iter_graph(lm) if isinstance(node, nnx.Param)]
    for i, (param_path, param) in enumerate(params):
        value = param.get_value()
        param.set_value(make(init_kind(str(param_path[-1])), tuple(value.shape), jnp.dtype(value.dtype), seed, i))


# Keyed by how the parameter starts, its shape and dtype (not its name): parameters alike share a
# program, so a model compiles a few of them (k and v projections, gate and up, the norms). The
# parameter's key is made inside (eagerly, making it would be two more programs per start).
@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _dummy_param(kind, shape, dtype, seed, index):
    return init_of_kind(kind, shape, dtype, jax.random.fold_in(jax.random.key(seed), index))


def _host_dummy_param(kind, shape, dtype, seed, index) -> jax.Array:
    """What _dummy_param makes (the same kinds and scales, other random values), drawn by numpy."""
    if kind in CONSTANT_INITS:
        values = np.full(shape, CONSTANT_INITS[kind], np.float32)
    else:
        values = np.random.default_rng((seed, index)).standard_normal(shape, np.float32)
        values *= np.float32(random_init_scale(dtype))
    return jax.device_put(values.astype(dtype))  # jnp.asarray would compile a program per shape


# --- safetensors ------------------------------------------------------------------------

def _safetensors_files(path: Path) -> dict[str, Path]:
    """Map each tensor name to the file that holds it (single file or sharded index)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: path / fname for name, fname in weight_map.items()}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    where = {}
    for f in files:
        with safe_open(f, framework="numpy") as handle:
            where.update({name: f for name in handle.keys()})
    return where


def _read_fp8(f: Path, name: str) -> np.ndarray | None:
    """An F8_E4M3 tensor, which safetensors' numpy reader cannot return: read it from the
    file's JSON header and byte range as an ml_dtypes array (None for other dtypes)."""
    with open(f, "rb") as handle:
        header_len = int.from_bytes(handle.read(8), "little")
        info = json.loads(handle.read(header_len))[name]
        if info["dtype"] != "F8_E4M3":
            return None
        start, end = info["data_offsets"]
        handle.seek(8 + header_len + start)
        data = np.frombuffer(handle.read(end - start), dtype=ml_dtypes.float8_e4m3fn)
    return data.reshape(info["shape"])


class _TensorReader:
    """Reads tensors by name across shards, keeping each file open once."""

    def __init__(self, path: Path):
        self.where = _safetensors_files(path)
        self.handles = {}

    def get(self, name: str) -> np.ndarray:
        if name not in self.where:
            raise ValueError(f"checkpoint is missing weight {name!r}")
        f = self.where[name]
        if f not in self.handles:
            self.handles[f] = safe_open(f, framework="numpy")
        try:
            return self.handles[f].get_tensor(name)
        except (AttributeError, TypeError):  # numpy has no float8 dtype of its own
            t = _read_fp8(f, name)
            if t is None:
                raise
            return t

    def assemble(self, source: WeightSource, layer: int | None = None, dequantize: bool = False) -> np.ndarray:
        """The parameter's value in our layout. `dequantize`: the model keeps this weight in
        a wide dtype, so an FP8 tensor of the checkpoint is multiplied out by its block scales."""
        if source.experts:
            return np.stack([self._assemble_one(source, layer, e, dequantize) for e in range(source.experts)])
        return self._assemble_one(source, layer, None, dequantize)

    def _assemble_one(self, source: WeightSource, layer, expert, dequantize) -> np.ndarray:
        parts = []
        for template in source.hf_names:
            name = template.format(i=layer, e=expert)
            t = self.get(name)
            if dequantize and t.dtype == ml_dtypes.float8_e4m3fn:
                t = _dequantize_np(t, self.get(name.replace(".weight", ".weight_scale_inv")))
            parts.append(t.T if source.transposed else t)
        return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=source.output_axis)


def _dequantize_np(w: np.ndarray, scale_inv: np.ndarray) -> np.ndarray:
    """FP8 [out, in] with [cdiv(out, b), cdiv(in, b)] block scales -> float32."""
    b_out = -(-w.shape[0] // scale_inv.shape[0])
    b_in = -(-w.shape[1] // scale_inv.shape[1])
    full = np.repeat(np.repeat(scale_inv.astype(np.float32), b_out, 0), b_in, 1)[: w.shape[0], : w.shape[1]]
    return w.astype(np.float32) * full


def _set_param(param: nnx.Param, value: np.ndarray, what: str):
    expected = param.get_value()
    if tuple(value.shape) != tuple(expected.shape):
        raise ValueError(f"weight {what} has shape {value.shape}, the config implies {expected.shape}")
    if (jnp.dtype(expected.dtype).itemsize == 1) != (value.dtype.itemsize == 1):
        raise ValueError(f"weight {what} is {value.dtype} in the checkpoint, the model expects {expected.dtype}")
    param.set_value(jnp.asarray(value, dtype=expected.dtype))


def _keeps_wide(param: nnx.Param) -> bool:
    return jnp.dtype(param.get_value().dtype).itemsize > 1


def load_safetensors(lm: CausalLM, path: Path) -> None:
    """Fill `lm`'s parameters (abstract or concrete) from a Hugging Face checkpoint."""
    reader = _TensorReader(path)
    spec = lm.spec
    for name, source in spec.global_weight_sources().items():
        param = getattr(lm, name)
        _set_param(param, reader.assemble(source, dequantize=_keeps_wide(param)), name)
    for attr, group in _stacked_groups(spec):
        for name, source in group.sources.items():
            param = getattr(getattr(lm, attr), name)
            stacked = np.stack([reader.assemble(source, i, _keeps_wide(param)) for i in group.layers])
            _set_param(param, stacked, f"{attr}.{name}")


def _stacked_groups(spec):
    """(model attribute, LayerGroup) for every stacked parameter group, MTP layers included."""
    groups = list(spec.layer_groups().items())
    if spec.mtp_group() is not None:
        groups.append(("mtp", spec.mtp_group()))
    return groups


def save_hf_checkpoint(lm: CausalLM, out_dir, dtype=jnp.bfloat16) -> Path:
    """Write config.json + model.safetensors with Hugging Face names (inverse of loading)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    spec = lm.spec
    tensors = {}

    def put(source: WeightSource, value: np.ndarray, layer=None):
        for e in range(source.experts) if source.experts else (None,):
            one = value if e is None else value[e]
            pieces = np.split(one, np.cumsum(source.widths)[:-1], axis=source.output_axis) if source.widths else [one]
            for n, piece in zip(source.hf_names, pieces):
                tensors[n.format(i=layer, e=e)] = np.ascontiguousarray(piece.T if source.transposed else piece)

    model_dtype = lm.embed_tokens.get_value().dtype

    def as_np(p):  # `dtype`, except parameters the family keeps in another (f32 bias, FP8)
        value = p.get_value()
        return np.asarray(value if value.dtype != model_dtype else jnp.asarray(value, dtype))

    for name, source in spec.global_weight_sources().items():
        put(source, as_np(getattr(lm, name)))
    for attr, group in _stacked_groups(spec):
        for name, source in group.sources.items():
            stacked = as_np(getattr(getattr(lm, attr), name))
            for j, i in enumerate(group.layers):
                put(source, stacked[j], i)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    spec.hf_config.dtype = jnp.dtype(dtype).name
    spec.hf_config.save_pretrained(str(out_dir))
    return out_dir
