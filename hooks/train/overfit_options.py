"""What defines an overfit run of ``mdb overfit`` (stored as the run's config, so it can resume):
:class:`OverfitOptions` (minillm memorises a text; :func:`default_overfit_text` is seed 000's)
and :class:`ModelOverfitOptions` (a user's ``module:function`` model), read back from the
store with a one-line error per bad field. The sessions that run them are in
:mod:`hooks.train.overfit`, which re-exports every name here.

This module never imports textual, rich or tui.
"""

from __future__ import annotations

import dataclasses
import math
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: The default overfit text: seed 000's test C sentence ×6, relative to the repository root.
DEFAULT_TEXT_PATH = Path(__file__).resolve().parents[2] / "samples" / "overfit_zh.txt"
#: Seed 000's test C sentence, used when ``samples/overfit_zh.txt`` is not available.
SEED_SENTENCE = "人工智能正在改变世界。"


def _fits(value: Any, hint: Any) -> bool:
    """Whether a value read from JSON fits a dataclass field's type (``int``, ``float``,
    ``str``, ``dict[...]``, ``X | None``; an ``int`` is a ``float`` too, a ``bool`` is neither)."""
    if hint is Any:
        return True
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(_fits(value, a) for a in args)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    origin = typing.get_origin(hint) or hint
    return isinstance(value, origin) if isinstance(origin, type) else True


def _type_words(hint: Any) -> str:
    words = {int: "an integer", float: "a number", str: "text", bool: "true or false",
             dict: "an object", type(None): "null"}
    parts = typing.get_args(hint) if typing.get_origin(hint) in (
        typing.Union, types.UnionType) else (hint,)
    return " or ".join(words.get(typing.get_origin(a) or a, str(a)) for a in parts)


class _StoredOptions:
    """What the options of both sessions share: the stored config and its common checks."""

    steps: int
    lr: float
    seed: int

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable dict (the run's stored config)."""
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]):
        """Inverse of :meth:`to_dict`; unknown keys are ignored (a later mdb may add some).

        Raises:
            ValueError: ``data`` is not a mapping, lacks a required field, or holds a value of
                the wrong type (``lr: "fast"``): one line naming the field.
        """
        if not isinstance(data, Mapping):
            raise ValueError(f"the run's stored config is {type(data).__name__}, not an object")
        hints = typing.get_type_hints(cls)
        kwargs = {}
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            if f.name not in data:
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    raise ValueError(f"the run's stored config has no {f.name!r}")
                continue
            value = data[f.name]
            if not _fits(value, hints[f.name]):
                shown = repr(value) if len(repr(value)) <= 30 else repr(value)[:29] + "…"
                raise ValueError(f"the run's stored config has {f.name} = {shown}, not "
                                 f"{_type_words(hints[f.name])}")
            if isinstance(value, int) and _type_words(hints[f.name]).startswith("a number"):
                value = float(value)
            kwargs[f.name] = value
        return cls(**kwargs)

    def _check(self, intervals: tuple[str, ...]) -> None:
        if self.steps < 1:
            raise ValueError(f"--steps must be at least 1, got {self.steps}")
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"--seed must be an integer in [0, 2**63), got {self.seed}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"--lr must be a positive number, got {self.lr}")
        for name in intervals:
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0")


@dataclass
class OverfitOptions(_StoredOptions):
    """Everything that defines an overfit run (stored as the run's config, so it can resume).

    Attributes:
        text: The text to memorise.
        text_source: Where it came from (a path, for display).
        model_config: ``MiniLLMConfig.to_dict()`` of the model *before* ``vocab_size`` is set
            to the tokenizer's size.
        preset: Preset name the config came from, if any (for display).
        steps: Total steps.
        lr: AdamW learning rate (constant).
        weight_decay: AdamW weight decay.
        seq_len: Tokens per sequence; ``None`` (or ≥ the text's length) trains on the whole text.
            Shorter: each step takes ``batch_size`` windows at offsets drawn from a generator
            seeded with ``seed + step`` (so a resumed run sees the same batches).
        batch_size: B, sequences per step.
        seed: Seeds the model's initialisation and the window offsets.
        every: Record internals (hooks statistics) every N steps (0: only on request).
        sample_every: Greedy continuation every N steps (0: never).
        prompt_chars: Characters of the text's beginning used as the sample prompt.
        sample_tokens: Tokens generated per sample.
        checkpoint_every: Also checkpoint every N steps (0: only at the end and on interruption).
        grad_clip: Clip the global gradient norm (``None``: off).
        schedule: ``"constant"`` (the tutorial's test C: ``lr`` at every step) or
            ``"warmup-cosine"`` (:func:`schedule_lr`: linear warmup over
            :data:`WARMUP_STEPS` steps, then a cosine decay to :data:`FINAL_LR_FRACTION` of
            ``lr`` at ``steps``; docs/spikes.md measures it).
        tokenizer: ``"char"`` (the text's characters, seed 000's) or ``"byte"``.
        held_out: Fraction of the text's tokens, at its end, never trained on (0: none); the
            training windows come from the rest. ``mdb ablate`` holds out text to evaluate on.
        eval_lengths: After the last step, the mean cross-entropy of the trained weights on
            held-out windows of each of these lengths is logged at that step as ``ce@N``
            (:meth:`OverfitSession.evaluate`); needs ``held_out``.
        eval_windows: At most this many non-overlapping held-out windows per length.
    """

    text: str
    text_source: str = "samples/overfit_zh.txt"
    model_config: dict[str, Any] = field(default_factory=dict)
    preset: str | None = "seed-test-c"
    steps: int = 300
    lr: float = 3e-3
    weight_decay: float = 0.01
    seq_len: int | None = None
    batch_size: int = 1
    seed: int = 0
    every: int = 0
    sample_every: int = 25
    prompt_chars: int = 4
    sample_tokens: int = 32
    checkpoint_every: int = 0
    grad_clip: float | None = None
    schedule: str = "constant"
    tokenizer: str = "char"
    held_out: float = 0.0
    eval_lengths: list[int] = field(default_factory=list)
    eval_windows: int = 16

    def validate(self) -> None:
        """Raise ``ValueError`` with one line naming the bad option."""
        if not self.text:
            raise ValueError("the text to memorise is empty")
        if not (0.0 <= self.held_out < 1.0):
            raise ValueError(f"--held-out must be in [0, 1), got {self.held_out}")
        if self.eval_lengths and not self.held_out:
            raise ValueError("evaluation lengths need held-out text (--held-out)")
        if any(int(n) < 2 for n in self.eval_lengths) or self.eval_windows < 1:
            raise ValueError("evaluation windows need at least 2 tokens, and at least 1 window")
        self._check(("every", "sample_every", "checkpoint_every"))
        if self.batch_size < 1:
            raise ValueError(f"--batch-size must be at least 1, got {self.batch_size}")
        if self.seq_len is not None and self.seq_len < 2:
            raise ValueError(f"--seq-len must be at least 2, got {self.seq_len}")
        if self.tokenizer not in ("char", "byte"):
            raise ValueError(f"tokenizer must be 'char' or 'byte', got {self.tokenizer!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"--schedule must be one of {', '.join(SCHEDULES)}, got "
                             f"{self.schedule!r}")


#: ``--schedule`` values.
SCHEDULES = ("constant", "warmup-cosine")
#: Steps of the warmup of ``warmup-cosine``.
WARMUP_STEPS = 20
#: The learning rate ``warmup-cosine`` ends at, as a fraction of ``lr``.
FINAL_LR_FRACTION = 0.1


def schedule_lr(schedule: str, lr: float, steps: int):
    """``lr_at(step) -> lr`` of a ``--schedule`` (``None`` for ``constant``): for
    ``warmup-cosine``, ``lr·t/W`` for ``t ≤ W`` (:data:`WARMUP_STEPS`), then
    ``lr·(f + (1 - f)·(1 + cos(π·(t - W)/(steps - W)))/2)`` with f =
    :data:`FINAL_LR_FRACTION` (Loshchilov & Hutter 2017, SGDR, without restarts)."""
    import math

    if schedule == "constant":
        return None
    w, f = WARMUP_STEPS, FINAL_LR_FRACTION
    span = max(1, steps - w)

    def lr_at(t: int) -> float:
        if t <= w:
            return lr * t / w
        x = min(1.0, (t - w) / span)
        return lr * (f + (1 - f) * 0.5 * (1 + math.cos(math.pi * x)))

    return lr_at


def default_overfit_text() -> tuple[str, str]:
    """``(text, source)`` of the default run: ``samples/overfit_zh.txt`` if present (one trailing
    newline dropped), else the seed sentence ×6."""
    if DEFAULT_TEXT_PATH.exists():
        text = DEFAULT_TEXT_PATH.read_text(encoding="utf-8")
        return text.removesuffix("\n").removesuffix("\r"), "samples/overfit_zh.txt"
    return SEED_SENTENCE * 6, "seed 000 test C sentence ×6"


@dataclass
class ModelOverfitOptions(_StoredOptions):
    """What defines an overfit run of a user's model (stored as the run's config).

    Attributes:
        model: The ``module:function`` (or ``path/to/file.py:function``) as given.
        model_path: The same with a file's path made absolute — what a resume imports, from
            any directory, when the file is unchanged (:attr:`model_sha256`).
        model_sha256: The sha256 of the file ``model_path`` imports, taken when the run was
            made (:func:`model_file_sha256`); ``""`` when it could not be read.
        model_files: ``[[path, sha256], ...]`` of every file importing ``model_path`` runs
            (for a module name, its packages' ``__init__.py`` first, then its file), taken when
            the run was made or its model named again
            (:func:`hooks.train.model_trust.model_files_sha256`).
        model_mac: This user's HMAC of ``model_path`` and ``model_files``
            (:func:`hooks.train.model_trust.model_mac`). A resume imports the stored model
            only when it verifies with this user's key and the files still have these
            hashes, or when the user names it on the command line
            (:func:`resume_model_refusal`).
        steps: Total steps.
        lr: AdamW learning rate (constant).
        weight_decay: AdamW weight decay.
        seed: ``torch.manual_seed`` before the factory runs (its weights and batch).
        every: Record internals (hooks statistics) every N steps (0: only on request).
        checkpoint_every: Also checkpoint every N steps (0: only at the end and on interruption).
        grad_clip: Clip the global gradient norm (``None``: off).
    """

    model: str
    model_path: str = ""
    model_sha256: str = ""
    model_files: list[Any] = field(default_factory=list)
    model_mac: str = ""
    steps: int = 300
    lr: float = 3e-3
    weight_decay: float = 0.01
    seed: int = 0
    every: int = 0
    checkpoint_every: int = 0
    grad_clip: float | None = None

    def __post_init__(self) -> None:
        if not self.model_path:
            self.model_path = resolve_model_spec(self.model)

    def validate(self) -> None:
        """Raise ``ValueError`` with one line naming the bad option."""
        self._check(("every", "checkpoint_every"))


def resolve_model_spec(spec: str) -> str:
    """``path/to/file.py:function`` with the file's path made absolute; a module spec as is."""
    module, sep, func = spec.partition(":")
    if sep and (module.endswith(".py") or os.sep in module):
        return f"{Path(module).resolve()}:{func}"
    return spec


def model_file(spec: str) -> Path | None:
    """The file ``--model spec`` imports, found without running any code: a ``.py`` (or a
    path) as given; a module name as ``import`` finds it, from the current directory first
    (as ``--model`` imports it), then ``sys.path``. ``None`` when there is none."""
    import importlib.machinery
    import sys

    module, _, _ = spec.partition(":")
    if module.endswith(".py") or os.sep in module:
        path = Path(module)
        return path if path.is_file() else None
    where: list[str] = [os.getcwd(), *sys.path]
    found = None
    for part in module.split("."):
        try:
            found = importlib.machinery.PathFinder.find_spec(part, where)
        except (ImportError, ValueError, OSError):
            return None
        if found is None:
            return None
        where = list(found.submodule_search_locations or [])
    origin = getattr(found, "origin", None)
    return Path(origin) if origin and os.path.isfile(origin) else None


def model_file_sha256(spec: str) -> str:
    """The sha256 (hex) of :func:`model_file`'s file, ``""`` when there is none or it cannot
    be read."""
    import hashlib

    path = model_file(spec)
    if path is None:
        return ""
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    except OSError:
        return ""
    return digest.hexdigest()


def sign_model(options: ModelOverfitOptions) -> None:
    """Record in ``options`` what importing ``options.model_path`` runs, as it is now, signed
    with this user's key (``model_sha256``, ``model_files``, ``model_mac``): done before the
    file is imported, when a run is made or its model named again.

    Raises:
        hooks.train.model_trust.ModelKeyError: This user's key cannot be created or read.
    """
    from hooks.train.model_trust import model_files_sha256, model_key, model_mac

    key = model_key()
    options.model_files = model_files_sha256(options.model_path)
    options.model_sha256 = options.model_files[-1][1] if options.model_files else ""
    options.model_mac = model_mac(options.model_path, options.model_files, key)


def resume_model_refusal(name: str, options: ModelOverfitOptions) -> str | None:
    """Why a resume of run ``name`` must not import the model its stored config names, or
    ``None`` when it may: the stored reference and file hashes carry this user's signature
    (:mod:`hooks.train.model_trust`: proof that mdb stored them here, not that a database
    from elsewhere names a file it knows the hash of), and every file importing it runs still
    has its stored hash. Nothing is imported to decide.

    Raises:
        hooks.train.model_trust.ModelKeyError: This user's key cannot be created or read.
    """
    from hooks.train.model_trust import mac_verifies, model_files_sha256, model_key

    spec = options.model_path or options.model
    again = f"to import it as it is now, name it again: --resume {name} --model {spec}"
    if not options.model_mac:
        return (f"run {name!r} imports its model from {spec}, and the database holds no "
                "signature of it by this user (a run made by an older mdb, or a database "
                f"from elsewhere); importing a file runs its code: {again}")
    if not mac_verifies(spec, options.model_files, options.model_mac, model_key()):
        return (f"run {name!r} imports its model from {spec}, and its signature is not this "
                "user's (a database from elsewhere, or a changed one): mdb imports only a "
                f"model named here; importing a file runs its code: {again}")
    now = model_files_sha256(spec)
    if not now:
        return (f"run {name!r} imports its model from {spec}, which is no longer there (or "
                "cannot be read); name the file to import: --model FILE:function")
    if now != options.model_files:
        return (f"the model file of run {name!r}, {spec}, changed since the run was made (the "
                f"sha256 of a file importing it runs is not the one stored); {again}")
    return None


#: How ``mdb overfit --nproc N`` split the model, by the run config's ``parallel`` (what
#: :mod:`hooks.train.ddp_overfit` records), in words.
PARALLEL_KINDS = {"ddp": "DDP", "fsdp": "FSDP2", "tp": "tensor parallel"}


def parallel_kind(config: Mapping[str, Any]) -> str | None:
    """How a distributed run split its model, in words: ``"DDP"``, ``"FSDP2"`` or ``"tensor
    parallel"``, from its stored config's ``parallel`` (the source of ``mdb compare``'s
    ``parallel`` row); a run of ``mdb overfit --nproc`` from before ``--fsdp``/``--tp`` has only
    ``nproc`` and was DDP. ``None`` when the config does not say (one process, or a
    ``torchrun`` job of the user's own loop); an unknown value is returned as it is stored."""
    kind = config.get("parallel")
    if isinstance(kind, str) and kind:
        return PARALLEL_KINDS.get(kind, kind)
    return "DDP" if "nproc" in config else None


def is_nproc_run(kind: str | None, world_size: int | None, config: Mapping[str, Any]) -> bool:
    """Whether a stored run (its ``kind``, ``world_size`` and config) was a job of ``mdb
    overfit --nproc N`` (DDP, ``--fsdp`` or ``--tp``): such a run keeps no checkpoints and
    its per-rank history is its own, so ``mdb overfit --resume`` does not apply to it."""
    return kind == "overfit" and (bool(world_size) or "nproc" in config)


def nproc_resume_error(name: str, kind: str | None, world_size: int | None,
                       config: Mapping[str, Any]) -> str | None:
    """The one line that refuses to resume run ``name`` when it was a job of ``mdb overfit
    --nproc N`` (:func:`is_nproc_run`), else ``None``. A resume would run it as one process
    from step 0 over the job's per-rank rows; the run is left as it is."""
    if not is_nproc_run(kind, world_size, config):
        return None
    n = world_size or config.get("nproc")
    what = parallel_kind(config) or "distributed"
    return (f"cannot resume run {name!r}: it was a job of {n} ranks ({what}, mdb overfit "
            "--nproc), which keeps no checkpoints; --resume applies to single-process runs "
            "only (start a new --nproc run instead)")
