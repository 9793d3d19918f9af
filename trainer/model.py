"""The tiny causal LM (transformers GPT-2 from scratch), its char tokenizer, and the critic.

Nothing is downloaded: the tokenizer is a fixed printable-ASCII vocabulary written as
``tokenizer.json`` beside the model. The critic is the same GPT-2 body with a scalar
value head, initialised from the SFT model like verl's critic.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
TOKENIZER_FILE = "tokenizer.json"


class CharTokenizer:
    """Character-level tokenizer: ids 0..2 are pad/eos/unk, then printable ASCII and newline."""

    def __init__(self, chars: Sequence[str] | None = None) -> None:
        chars = list(chars) if chars is not None else ["\n"] + [chr(c) for c in range(32, 127)]
        self.itos: list[str] = [PAD, EOS, UNK, *chars]
        self.stoi = {s: i for i, s in enumerate(self.itos)}
        self.pad_id, self.eos_id, self.unk_id = 0, 1, 2

    @property
    def vocab_size(self) -> int:
        """Number of ids."""
        return len(self.itos)

    def encode(self, text: str) -> list[int]:
        """Text -> ids (unknown characters -> unk)."""
        return [self.stoi.get(ch, self.unk_id) for ch in text]

    def decode(self, ids: Sequence[int]) -> str:
        """Ids -> text, stopping at EOS and dropping pads."""
        out = []
        for i in ids:
            i = int(i)
            if i == self.eos_id:
                break
            if i == self.pad_id:
                continue
            out.append(self.itos[i] if 0 <= i < len(self.itos) else "")
        return "".join(out)

    def save(self, directory: str | Path) -> None:
        """Write tokenizer.json."""
        Path(directory, TOKENIZER_FILE).write_text(json.dumps({"type": "char", "chars": self.itos[3:]}))

    @classmethod
    def load(cls, directory: str | Path) -> CharTokenizer:
        """Read tokenizer.json."""
        doc = json.loads(Path(directory, TOKENIZER_FILE).read_text())
        return cls(doc["chars"])


def build_policy(vocab_size: int, n_positions: int, n_layer: int = 2, n_embd: int = 128, n_head: int = 4,
                 seed: int = 0) -> nn.Module:
    """A GPT-2 LM from scratch; dropout off so a step depends only on the seeded sampling."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=vocab_size, n_positions=n_positions, n_embd=n_embd, n_layer=n_layer, n_head=n_head,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=1, pad_token_id=0,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = GPT2LMHeadModel(config)
    return model


def save_policy(model: Any, tokenizer: CharTokenizer, directory: str | Path) -> Path:
    """save_pretrained (safetensors) + tokenizer.json."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model.save_pretrained(directory)
    tokenizer.save(directory)
    return directory


def load_policy(directory: str | Path) -> tuple[nn.Module, CharTokenizer]:
    """Model and tokenizer saved by :func:`save_policy` (safetensors: no pickle)."""
    from transformers import GPT2LMHeadModel
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # its per-load bars would bury the trainer's own progress
    model = GPT2LMHeadModel.from_pretrained(directory)
    return model, CharTokenizer.load(directory)


class Critic(nn.Module):
    """GPT-2 body + linear value head; values are read at the positions that predict each response token."""

    def __init__(self, policy: Any) -> None:
        super().__init__()
        from transformers import GPT2Model

        body = GPT2Model(policy.config)
        body.load_state_dict(policy.transformer.state_dict())
        self.body = body
        self.value_head = nn.Linear(policy.config.n_embd, 1)
        # Zero init: the first values are 0, so early advantages equal the returns and the
        # critic's warm-up does not inject random value noise into the policy gradient.
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                position_ids: torch.Tensor) -> torch.Tensor:
        """Per-position scalar values, shape (batch, seq)."""
        hidden = self.body(input_ids=input_ids, attention_mask=attention_mask,
                           position_ids=position_ids).last_hidden_state
        return self.value_head(hidden).squeeze(-1)


def position_ids_for(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding (as verl computes them)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def response_logits(policy: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    response_length: int, temperature: float = 1.0) -> torch.Tensor:
    """Logits that predict the response tokens, (batch, response_length, vocab), divided by temperature."""
    out = policy(input_ids=input_ids, attention_mask=attention_mask,
                 position_ids=position_ids_for(attention_mask))
    logits = out.logits[:, -response_length - 1:-1, :]
    return logits / temperature


def response_values(critic: Critic, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    response_length: int) -> torch.Tensor:
    """Values of the states before each response token, (batch, response_length)."""
    values = critic(input_ids, attention_mask, position_ids_for(attention_mask))
    return values[:, -response_length - 1:-1]
