"""Loading a pair: a target checkpoint (any layout that loads), its drafter and tokenizer, the
checks made before any weight is read, the memory pre-flight and the warm-up; :class:`Pair`,
what ``md.load`` returns."""

from __future__ import annotations

import functools
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from .checkpoint.integrity import check_level
from .decode.session import Session
from .decode.warm import warm_up
from .request import speculative_mode
from .text.tokenizer import load_tokenizer

DEMO = Path(__file__).parent / "demo"


@dataclass
class Pair:
    """A target, its drafter (None: serial decoding only) and the tokenizer (None: token-id
    prompts only, empty texts)."""

    target: object
    drafter: object = None
    tokenizer: object = None
    # What the break-even controller learned in earlier calls (costs, acceptance): a fresh
    # call starts from it instead of paying the warm-up round again.
    controller: object = field(default=None, repr=False)
    path: Path | None = None      # the target's directory (md.load sets it)
    # The target's and drafter's conversion-receipt hashes (None without a receipt): what
    # snapshots on disk are keyed to.
    receipts: tuple = (None, None)
    # Snapshots calls without a session continue from (prompt_cache.PromptCache), or None.
    prompt_cache: object = field(default=None, repr=False)
    # Which drafter and why, or "serial only (why)": the banners' words (md.load sets it).
    drafter_note: str = ""
    # MLX work on one pair runs one step at a time: generations from several threads take
    # turns token by token (and one thread may still interleave several generations).
    lock: threading.RLock = field(default_factory=threading.RLock, repr=False, compare=False)

    def __repr__(self) -> str:
        """One line: where the target came from, which drafter and why (the dataclass's own
        repr printed every module of both models)."""
        where = str(self.path) if self.path is not None else type(self.target).__name__
        drafter = self.drafter_note or ("no drafter" if self.drafter is None
                                        else type(self.drafter).__name__)
        tokenizer = "" if self.tokenizer is not None else ", no tokenizer"
        return f"Pair({where}, {drafter}{tokenizer})"

    def session(self, speculative=None) -> Session:
        """A decoding state of its own (target and drafter caches): pass it to successive
        calls whose prompts extend each other (a chat) and only the new tokens are
        prefilled; a history rendered otherwise goes on from before the previous prompt's
        last token, and new messages alone continue the conversation held (mlx-lm's
        ``prompt_cache`` habit; docs/prompt-cache.md). Any number of sessions live on one
        pair. The pair keeps what the sessions' controller learns about this machine.

        The mode belongs to each call (``speculative=``); the argument here is accepted for
        code written before, and ignored."""
        if speculative is not None:
            speculative_mode(speculative)
            warnings.warn("pair.session(mode): a session no longer takes a mode; pass "
                          "speculative= to each generate() call", DeprecationWarning,
                          stacklevel=2)
        return Session(self.target, self.drafter, home=self, keep_prompt=True)

    def __iter__(self):
        # mlx-lm's ``model, tokenizer = load(...)``: one line with this package's spelling.
        raise TypeError("md.load() returns one Pair, not (model, tokenizer): write "
                        "`pair = md.load(...)` and `md.generate(pair, prompt)`; its parts are "
                        "pair.target, pair.drafter and pair.tokenizer")

    def __reduce_ex__(self, protocol):
        # pickle and copy: the models' MLX arrays and compiled kernels live in this process
        raise TypeError("a Pair cannot be pickled or copied: its models live in this "
                        "process's memory. Load the pair in the other process (md.load with "
                        "the same arguments); to carry a conversation's state over, give "
                        "both md.load(..., prompt_cache_dir=DIR) (snapshots on disk), or "
                        "use chat's /save and --resume; dataclasses.replace(pair, ...) "
                        "makes a variant in this process")

    @functools.cached_property
    def decodable(self) -> int | None:
        """How many ids the tokenizer can decode, when fewer than the model's vocabulary (a
        padded embedding); the others are never sampled. None when all can be."""
        if self.tokenizer is None:
            return None
        ids = max(self.tokenizer.get_vocab().values(), default=-1) + 1
        return ids if ids < self.target.config.vocab_size else None

    def stop_tokens(self) -> frozenset:
        """The ids that always end a generation (the tokenizer's eos ids)."""
        return frozenset(self.tokenizer.eos_token_ids) if self.tokenizer is not None \
            else frozenset()


def load(model=None, drafter=None, dtype=None, verify: str = "auto",
         memory_check: bool = True, warm: bool = True,
         prompt_cache_dir=None, prompt_cache_disk_gb: float = 10.0,
         prompt_cache_mb: int = 1024, allowed_local_media_path=None) -> Pair:
    """Load a converted target (and drafter).

    ``dtype``: ``"bfloat16"``, ``"float16"``, ``"float32"`` or the MLX dtype (None: bf16 on a
    GPU, fp32 on the CPU). ``model``: a local directory of a converted target, or the Hugging
    Face repo id of a ModelOpt export, converted on first use into the cache (checkpoint/hub.py);
    a local directory wins over a repo id of the same spelling. ``drafter``: ``"mtp"`` (the
    target's own MTP block, kept by ``convert`` unless ``--no-mtp``), or a converted DSpark
    drafter or EAGLE-3 head (a directory or repo id; which one its config.json says).
    ``"none"``: no drafter. ``"auto"``: the drafter made for the model, recognised by its
    config (checkpoint/pairing.py: NVIDIA's DSpark drafter for Nemotron 3.5 Lightning, in any
    layout), else none; the CLI's default with ``--model``. ``model=None`` loads the embedded
    demonstration pair (a small demo model, not Nemotron); then ``drafter`` None or
    ``"dspark"`` (``"mtp"``, ``"eagle3"``, ``"dflash"``) names an embedded demo drafter. With
    an explicit ``model``, ``drafter=None`` means no drafter (serial decoding). ``model`` may
    be in mlx-lm's layout or a plain Hugging Face download, loaded as it is (docs/formats.md).
    ``verify``: how much of both checkpoints is checked against their conversion receipts
    before loading: ``"auto"`` (default: every byte of a small checkpoint, sizes and sampled
    blocks of a large one), ``"full"``, ``"fast"``, or ``"none"`` for directories without a
    receipt (docs/integrity.md). ``memory_check``: first estimate what the pair needs and raise
    memory.InsufficientMemory (a ValueError) when the device cannot give it
    (docs/history/real-size.md). ``warm``: run :func:`warm_up` before returning, so that the
    first generation is timed (and "auto" decides) on warm kernels.

    ``prompt_cache_dir``: calls without a ``session`` continue from snapshots of earlier
    prompts (message ends, every few thousand tokens, ends of prompts and answers), kept in
    memory (``prompt_cache_mb``) and in this directory (``prompt_cache_disk_gb``, least
    recently used first out), so a long shared prefix is prefilled once, across restarts
    (docs/prompt-cache.md).

    A Nemotron Omni parent with the ``omni`` extra installed takes images and audio as
    message content parts (docs/formats.md); ``allowed_local_media_path``: the directory
    whose files ``file://`` image URLs may name (none by default)."""
    from .checkpoint import hub, pairing
    from .checkpoint.formats import convert_first, detect_dir
    from .checkpoint.memory import check_download, check_fits
    from .checkpoint.recorded import recorded_hash
    from .drafters import DEFAULT_DEMO, check_pairing, load_drafter, locate, of_target
    from .media import omni as media
    from .models.nemotron_h import (TargetConfig, check_shapes, compute_dtype, load_target,
                                     read_target_config)
    from .prompt_cache.disk import receipt_hash

    why = {"none": "--drafter none", None: "no drafter named"}.get(drafter, "")
    demo = model is None
    if drafter == "none":
        drafter = None
    elif demo:
        drafter = locate(DEFAULT_DEMO if drafter in (None, "auto") else drafter, DEMO)
    elif drafter not in (None, "auto"):
        drafter = locate(drafter)   # a demo drafter's name without the demo target: refused
    model = DEMO / "target" if demo else model
    check_level(verify)
    check_sources(model, drafter)
    dtype = compute_dtype(dtype)
    model = hub.resolve(model, "model", check_download if memory_check else None)
    fmt = detect_dir(model)     # what cannot run (a drafter, another model, GGUF...): said first
    if fmt.layout == "modelopt":
        raise ValueError(convert_first(model, fmt))
    raw = read_target_config(model)
    if drafter == "auto":
        drafter, why = pairing.resolve_default(raw)
    elif drafter is not None and not of_target(drafter):
        drafter = hub.resolve(drafter, "drafter")
    # Config (against the safetensors headers), tokenizer and pairing first: what is wrong
    # with them is said before any weight is read, not after a multi-GB load.
    config = TargetConfig.from_dict(raw, str(Path(model) / "config.json"))
    check_shapes(model, raw, config, fmt)
    tokenizer = load_tokenizer(model, config.vocab_size)
    if drafter is not None:
        check_pairing(drafter, config)
    if memory_check:
        check_fits(model, drafter, dtype)
    target = load_target(model, dtype=dtype, verify=verify)
    own = receipt_hash(model) or recorded_hash(model)     # what disk snapshots are keyed by
    pair = Pair(target=target,
                drafter=(load_drafter(drafter, target, verify=verify)
                         if drafter is not None else None),
                tokenizer=tokenizer, path=Path(model),
                receipts=(own, f"{drafter}:{own}" if of_target(drafter)
                          else receipt_hash(drafter)))
    pair.drafter_note = drafter_note(pair.drafter, drafter, why, demo)
    media.attach(pair, allowed_local_media_path)
    if prompt_cache_dir is not None:
        from .prompt_cache.cache import PromptCache
        from .prompt_cache.disk import open_store
        store = open_store(prompt_cache_dir, pair, pair.drafter is not None,
                           int(prompt_cache_disk_gb * 1e9))
        pair.prompt_cache = PromptCache(prompt_cache_mb << 20, store)
    if warm:
        warm_up(pair)
    return pair


def kernel_cache_cold() -> bool:
    """Whether MLX's CPU backend will compile its kernels first (its disk cache, under the
    temporary directory, is empty): a fresh machine's first run. Always False on a GPU."""
    import tempfile

    import mlx.core as mx
    from .device import on_gpu

    if on_gpu():
        return False
    cache = Path(tempfile.gettempdir()) / "mlx" / mx.__version__ / "cpu"
    return not any(cache.glob("*.so"))


def drafter_note(loaded, name, why: str, demo: bool) -> str:
    """The banners' words for a pair's drafter: "with its DSpark drafter" (the demo's, or the
    target's own MTP block), "with the EAGLE-3 drafter DIR (why)", "serial only (why)"."""
    from .drafters import of_target

    if loaded is None:
        return f"serial only ({why})"
    kind = getattr(loaded, "label", "DSpark")
    if demo or of_target(name):
        return f"with its {kind} drafter"
    return f"with the {kind} drafter {name}" + (f" ({why})" if why else "")


def load_another_drafter(pair: Pair, name, demo: bool, verify: str = "auto"):
    """One more drafter for ``pair``'s target (``bench --drafter A --drafter B``), named as
    :func:`load` names one (``demo``: the pair is the embedded demo pair)."""
    from .checkpoint import hub
    from .drafters import load_drafter, locate, of_target

    name = locate(name, DEMO if demo else None)
    if not of_target(name):
        if not hub.is_repo_id(name) and not Path(name).expanduser().is_dir():
            raise FileNotFoundError(f"{name}: no such drafter directory")
        name = hub.resolve(name)
    return load_drafter(name, pair.target, verify=verify)


def check_sources(model, drafter=None) -> None:
    """FileNotFoundError naming a ``model`` or ``drafter`` that is neither a directory nor a
    repo id: a check that reads nothing, made before anything slower (a port, a download)."""
    from .checkpoint import hub
    from .checkpoint.formats import file_kind
    from .drafters import of_target

    for name, what in ((model, "model"), (drafter, "drafter")):
        if name is not None and not of_target(name) and name not in ("none", "auto") \
                and not hub.is_repo_id(name) \
                and not Path(name).expanduser().is_dir():
            if Path(name).expanduser().is_file():
                raise FileNotFoundError(f"{name}: {file_kind(name)}, not a {what} directory; "
                                        f"mlx-dspark runs safetensors checkpoint directories "
                                        f"(docs/formats.md)")
            raise FileNotFoundError(f"{name}: no such {what} directory")
