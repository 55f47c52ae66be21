"""What a minillm workload is made of: its config (``--preset``/``--config``), the text of its
batch (``--text``), the tokenizer and the (B, T) ids cut from that text, and the memory one
captured step needs (checked before anything is allocated). Bad input raises
:class:`tui.errors.MdbError` with one line that says what to fix. torch and minillm are
imported inside the functions that need them.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from tui.errors import MdbError

REPO_ROOT = Path(__file__).resolve().parent.parent.parent


def samples_dir() -> Path:
    """The ``samples/`` folder: ``$MDB_SAMPLES`` if set, else the one beside the packages."""
    env = os.environ.get("MDB_SAMPLES")
    return Path(env) if env else REPO_ROOT / "samples"


def default_text_path() -> Path:
    """The text ``mdb step`` runs on when ``--text`` is not given."""
    return samples_dir() / "alice.txt"



#: Largest ``--text`` file read (bytes); a batch needs far less.
MAX_TEXT_BYTES = 64 << 20


def read_text(path: str | os.PathLike) -> str:
    """The UTF-8 text of ``path``; missing, unreadable, empty, non-UTF-8, not a regular file
    (a FIFO or ``/dev/zero`` would hang or never end) or larger than :data:`MAX_TEXT_BYTES`
    -> MdbError."""
    import stat

    p = Path(path)
    if not p.exists():
        raise MdbError(f"--text {p}: no such file")
    if p.is_dir():
        raise MdbError(f"--text {p}: is a directory, not a text file")
    try:
        st = p.stat()
    except OSError as exc:
        raise MdbError(f"--text {p}: cannot read ({exc.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise MdbError(f"--text {p}: not a regular file (a device, FIFO or socket); give a "
                       "text file")
    if st.st_size > MAX_TEXT_BYTES:
        raise MdbError(f"--text {p}: {human_bytes(st.st_size)} is more text than a batch "
                       f"needs (at most {human_bytes(MAX_TEXT_BYTES)}); cut a part of it")
    try:
        with open(p, "rb") as f:
            data = f.read(MAX_TEXT_BYTES + 1)
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MdbError(f"--text {p}: not UTF-8 text (bad byte at offset {exc.start})") from None
    except OSError as exc:
        raise MdbError(f"--text {p}: cannot read ({exc.strerror})") from None
    if not text.strip():
        raise MdbError(f"--text {p}: the file is empty")
    return text


def load_config(args: argparse.Namespace):
    """The minillm config chosen by ``--preset`` / ``--config`` (default preset ``default``)."""
    from minillm import MiniLLMConfig, load_preset

    if getattr(args, "config", None):
        path = Path(args.config)
        if not path.exists():
            raise MdbError(f"--config {path}: no such file")
        if not path.is_file():
            raise MdbError(f"--config {path}: not a file (give a .toml file, see samples/presets)")
        try:
            return MiniLLMConfig.from_toml(path)
        except (ValueError, TypeError) as exc:
            raise MdbError(f"--config {path}: {exc}") from None
        except OSError as exc:
            raise MdbError(f"--config {path}: cannot read ({exc.strerror or exc})") from None
    try:
        return load_preset(getattr(args, "preset", None) or "default")
    except ValueError as exc:
        raise MdbError(str(exc)) from None


def available_memory() -> int | None:
    """Bytes of memory available to a new allocation (``MemAvailable`` of /proc/meminfo, else
    the free physical pages), or None when the system does not say."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def human_bytes(n: float) -> str:
    """``4.1 TB``, ``23.1 GB``, ``512 MB`` (powers of 1000, like disk sizes)."""
    for unit in ("B", "kB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1000:
            return f"{n:.3g} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:,.3g} EB" if n < 1000 else f"{n:,.0f} EB"


def human_count(n: int) -> str:
    """``19.8M``, ``113k``, ``950`` — a parameter count in three significant digits."""
    for unit, size in (("B", 10**9), ("M", 10**6), ("k", 10**3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def step_memory(config, batch_size: int, seq_len: int) -> tuple[int, int]:
    """A lower bound of the bytes one captured fp32 forward+backward of a minillm needs:
    ``(parameters and their gradients, activations)``. Activations count per token the
    residual-stream tensors of each layer (~16·D), the k routed SwiGLU widths (3·k·I or 3·I),
    the attention scores (2·H·T) and the logits with their gradient (3·V); the RoPE cos/sin
    tables (2·P·Dh) count with the parameters."""
    params = config.parameter_count()
    rope = 2 * config.max_position_embeddings * config.head_dim * 4 \
        if config.position_embedding == "rope" else 0
    k = config.num_experts_per_tok if config.num_local_experts else 1
    d, i = config.hidden_size, config.intermediate_size
    per_token = config.num_hidden_layers * (16 * d + 3 * k * i
                                            + 2 * config.num_attention_heads * seq_len)
    per_token += 3 * config.vocab_size
    return 8 * params + rope, 4 * per_token * batch_size * seq_len


def check_memory(config, batch_size: int, seq_len: int) -> None:
    """Refuse, before allocating anything, a model and batch that cannot fit in memory.

    Raises:
        MdbError: ``needs 4.1 TB (parameters and gradients 4.1 TB, activations 2.1 GB) for one
            step; this machine has 23.1 GB available``.
    """
    params, acts = step_memory(config, batch_size, seq_len)
    free = available_memory()
    if free is not None and params + acts > free:
        raise MdbError(
            f"this model and batch need at least {human_bytes(params + acts)} (parameters, "
            f"gradients and tables {human_bytes(params)}, activations {human_bytes(acts)}) for "
            f"one step; this machine has {human_bytes(free)} available: choose a smaller config, "
            f"--batch-size or --seq-len")


def tokenizer_for(text: str, vocab_size: int):
    """UTF-8 bytes when the vocabulary holds 256 ids, else the text's characters."""
    from minillm import ByteTokenizer, CharTokenizer

    if vocab_size >= ByteTokenizer.vocab_size:
        return ByteTokenizer()
    tok = CharTokenizer.from_text(text)
    if tok.vocab_size > vocab_size:
        raise MdbError(
            f"the text has {tok.vocab_size} distinct characters but the model's vocab_size is "
            f"{vocab_size}; use a config with vocab_size >= 256 (bytes) or >= {tok.vocab_size}"
        )
    return tok


def batch_from_text(text: str, tokenizer, batch_size: int, seq_len: int):
    """(B, T) ids: B consecutive windows of T tokens from the start of the text (the token
    stream is repeated when the text is shorter than B·T tokens)."""
    import torch

    ids = tokenizer.encode(text)
    need = batch_size * seq_len
    if len(ids) < need:
        ids = (ids * (need // len(ids) + 1))[:need]
    return torch.tensor(ids[:need], dtype=torch.long).view(batch_size, seq_len)
