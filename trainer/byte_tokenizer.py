"""A byte-level BPE tokenizer without merges, built locally (no hub) for the tiny CPU models.

GPT-2's 256 byte characters plus a few special tokens: any text round-trips and every byte is one
token. transformers 5 rebuilds a qwen2 tokenizer as byte-level BPE anyway, so a character
vocabulary would silently lose its whitespace. Used by the verl-on-CPU and the TRL assets.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def byte_chars() -> list[str]:
    """GPT-2's byte-to-unicode table as a list indexed by byte (what byte-level BPE uses)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = keep[:], 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(keep, cs, strict=True))
    return [chr(table[b]) for b in range(256)]


def byte_level_tokenizer(specials: Sequence[str], **kwargs: Any) -> Any:
    """A ``PreTrainedTokenizerFast`` over :func:`byte_chars` and ``specials`` (eos ``<|im_end|>``, pad
    ``<|endoftext|>``); ``kwargs`` go to its constructor (e.g. ``model_max_length``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(byte_chars())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(specials))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, unk_token=None, **kwargs)
