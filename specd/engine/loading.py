"""Loading a causal LM and its tokenizer, and reading the checkpoint's decoding defaults."""

from __future__ import annotations

import dataclasses
import logging

import torch

from specd.core.sampling import SamplingSettings
from specd.core.tokenizer_spec import fingerprint
from specd.engine.backends import resolve_device
from specd.engine.draft_model import DraftLlamaForCausalLM, borrow_from_target
from specd.engine.model_names import DTYPE_NAMES, model_source, resolve

log = logging.getLogger(__name__)

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}

# generation_config fields that change what plain decoding emits but that specd
# does not apply; a checkpoint setting one is served without it, and says so.
_UNSUPPORTED_PROCESSING = {
    "no_repeat_ngram_size": 0,
    "encoder_repetition_penalty": 1.0,
    "min_p": None,
    "typical_p": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "bad_words_ids": None,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
}


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    name: str
    model: torch.nn.Module
    tokenizer: object
    vocab_size: int  # ids a request may carry: the tokenizer's, capped by the embedding
    context_length: int
    eos_token_ids: tuple[int, ...]
    default_sampling: SamplingSettings
    tokenizer_fingerprint: str
    dtype: str
    device: str


def load_tokenizer(name: str, **from_pretrained_kwargs):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve(name), **from_pretrained_kwargs)


def load_causal_lm(name: str, dtype: str = "float32", device: str = "cpu", **from_pretrained_kwargs) -> LoadedModel:
    """Load any HF causal LM from a local folder or hub id, ready for inference."""
    from transformers import AutoModelForCausalLM

    device = resolve_device(device)
    source, source_kwargs = model_source(name)  # fails here, with a clear message, on what cannot load
    tokenizer = load_tokenizer(name, **source_kwargs)
    # dtype at load time, not .to() afterwards: .to() would also cast the rotary buffers.
    model = AutoModelForCausalLM.from_pretrained(source, dtype=DTYPES[dtype], **source_kwargs, **from_pretrained_kwargs)
    if isinstance(model, DraftLlamaForCausalLM):
        borrow_from_target(model, resolve(model.config.borrows_from))
    if "device_map" not in from_pretrained_kwargs and "distributed_config" not in from_pretrained_kwargs:
        model = model.to(device)
    model.eval()
    embedding_rows = model.get_input_embeddings().weight.shape[0]
    return LoadedModel(
        name=name,
        model=model,
        tokenizer=tokenizer,
        vocab_size=min(len(tokenizer), embedding_rows),
        context_length=context_length(model.config),
        eos_token_ids=eos_token_ids(model, tokenizer),
        default_sampling=default_sampling(model),
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
        dtype=dtype,
        device=device,
    )


def context_length(config) -> int:
    for attr in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return 2048


def eos_token_ids(model, tokenizer) -> tuple[int, ...]:
    """Every id that ends plain decoding: the generation config's (often several), else the tokenizer's."""
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if configured is None:
        configured = getattr(model.config, "eos_token_id", None)
    if configured is None:
        configured = tokenizer.eos_token_id
    if configured is None:
        return ()
    ids = [configured] if isinstance(configured, int) else list(configured)
    return tuple(sorted(set(int(i) for i in ids)))


def default_sampling(model) -> SamplingSettings:
    """What plain `generate` would do with this checkpoint's generation_config."""
    config = getattr(model, "generation_config", None)
    _warn_unsupported(config)
    penalty = getattr(config, "repetition_penalty", None)
    penalty = float(penalty) if penalty is not None else 1.0  # greedy decoding applies it too
    if config is None or not getattr(config, "do_sample", False):
        return SamplingSettings(temperature=0.0, repetition_penalty=penalty)
    return SamplingSettings(
        temperature=float(config.temperature if config.temperature is not None else 1.0),
        top_k=int(config.top_k or 0),
        top_p=float(config.top_p if config.top_p is not None else 1.0),
        repetition_penalty=penalty,
    )


def _warn_unsupported(config) -> None:
    if config is None:
        return
    for field, neutral in _UNSUPPORTED_PROCESSING.items():
        value = getattr(config, field, neutral)
        if value not in (neutral, None):
            log.warning("generation_config.%s=%r is not applied by specd", field, value)


def tokenizer_fingerprint(tokenizer) -> str:
    """A digest of the string -> id mapping: equal digests mean the same ids for the same strings."""
    return fingerprint(tokenizer.get_vocab())
