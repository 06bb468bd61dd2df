"""How the runner drafts with a model drafter (engine/runner/model_runner.py `_draft`): the hidden state of
the first draft step, one step's forward, and its greedy tokens."""
from __future__ import annotations

import torch


class MtpDraft:
    """The target's own MTP layer (engine/models/mtp.py): it reads the target's last hidden state."""

    needs_eager_target = False
    exchanges_experts = True  # its decoder layer is a MoE layer like the target's (EP exchanges)

    def __init__(self, model) -> None:
        self.model = model

    def first_hidden(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return hidden[rows]

    def forward(self, input_ids: torch.Tensor, previous: torch.Tensor, positions: torch.Tensor):
        return self.model.mtp_forward(input_ids, previous, positions)

    def tokens(self, normed: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(normed).argmax(dim=-1)


class Eagle3Draft:
    """An EAGLE3 head (engine/models/eagle3.py): it reads the inputs of some of the target's layers, which
    the target's layers keep while they run eagerly (decode graphs are not captured with it)."""

    needs_eager_target = True
    exchanges_experts = False  # a dense Llama layer

    def __init__(self, model, drafter, layer_ids: tuple[int, ...]) -> None:
        self.model, self.drafter, self.layer_ids = model, drafter, layer_ids

    def first_hidden(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        layers = self.model.model.layers
        states = [layers[i].captured[rows].to(hidden.dtype) for i in self.layer_ids]
        return self.drafter.fc(torch.cat(states, dim=-1))

    def forward(self, input_ids: torch.Tensor, previous: torch.Tensor, positions: torch.Tensor):
        embed = self.drafter.embed_tokens if self.drafter.embed_tokens is not None else self.model.model.embed_tokens
        return self.drafter(embed(input_ids), previous, positions)

    def tokens(self, normed: torch.Tensor) -> torch.Tensor:
        return self.drafter.tokens(normed)
