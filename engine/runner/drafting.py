"""A runner's model drafter for speculative decoding (the checkpoint's MTP layer, an EAGLE3 head): after each
step, its draft passes over the positions the step kept, then its chained single-token passes
(docs/ARCHITECTURE.md, "Speculative decoding")."""
from __future__ import annotations

import numpy as np
import torch

from engine.core.scheduler_output import SchedulerOutput
from engine.forward_context import MoEStep, forward_context
from engine.models.eagle3 import build_eagle3
from engine.runner.cuda_graphs import padded_step_tokens
from engine.runner.input_batch import HostInputs
from engine.spec_decode.draft_models import Eagle3Draft, MtpDraft


class DraftRunner:
    """`drafter`: what differs between drafters (engine/spec_decode/draft_models.py); `num_tokens`: drafts a
    step; `in_lockstep`: a drafter with experts under lockstep DP + EP, whose every pass every rank runs."""

    def __init__(self, runner, drafter, num_tokens: int, in_lockstep: bool) -> None:
        self.runner, self.drafter, self.num_tokens, self.in_lockstep = runner, drafter, num_tokens, in_lockstep

    @property
    def needs_eager_target(self) -> bool:
        return self.drafter.needs_eager_target

    def empty_passes(self, scheduled: SchedulerOutput) -> None:
        """A dummy step's draft passes under lockstep: the other ranks' drafters exchange tokens k times."""
        if self.in_lockstep:
            padded = padded_step_tokens(self.runner._step_tokens(scheduled), self.runner.step_buckets)
            for _ in range(self.num_tokens):
                self.empty_pass(padded)

    def draft(self, host: HostInputs, hidden: torch.Tensor, scheduled: SchedulerOutput) -> dict[str, list[int]]:
        """Drafts with the model drafter (MTP layer, EAGLE3 head), after the step's tokens are recorded. First
        over every position the step computed and kept (the drafter's own cache entries for them, which later
        drafts attend to): position p takes token p + 1 and the target's hidden state(s) at p; a sampling
        request's last kept position gives its first draft. Then k - 1 single-token steps, each from the
        previous draft and the drafter's own pre-norm hidden state, at the next position (blocks the scheduler
        gave as lookahead; a request out of blocks or context stops drafting). Greedy (argmax) drafts."""
        runner = self.runner
        rows, ids, positions, starts, seq_lens, computed, slots = [], [], [], [0], [], [], []
        last_rows, drafting = [], []
        sampling = {request.request_id for request in host.sampling_requests}
        for index, request in enumerate(host.requests):
            begin, start = host.query_start_loc[index], host.num_computed[index]
            kept = request.num_computed_tokens - start  # positions of this step whose tokens stayed
            rows.extend(range(begin, begin + kept))
            ids.extend(request.token_ids[start + 1:start + kept + 1])
            positions.extend(range(start, start + kept))
            slots.append(host.slot_mapping[begin:begin + kept])
            starts.append(starts[-1] + kept)
            seq_lens.append(start + kept)
            computed.append(start)
            if request.request_id in sampling and request.request_id in scheduled.draft_request_ids:
                last_rows.append(starts[-1] - 1)
                drafting.append(request)
        num_decodes = next((i for i, n in enumerate(np.diff(starts)) if n != 1), len(seq_lens))
        tables = [host.block_table, *host.group_tables]
        metadata = runner._attention_metadata(num_decodes, starts, seq_lens, computed, tables,
                                            [np.concatenate(slots), *host.group_slot_mappings], host.state_slots,
                                            runner._group_keys)
        first = self.drafter.first_hidden(hidden, runner._to_device(np.asarray(rows)))
        # Lockstep DP + EP: a drafter with experts exchanges tokens in each pass, so every rank runs k passes
        # a step, padded as the step's own exchanges are (ranks without drafts run empty ones).
        padded = padded_step_tokens(runner._step_tokens(scheduled), runner.step_buckets) if self.in_lockstep else None
        normed, pre = self._pass(metadata, ids, positions, first, padded)
        if not drafting:
            for _ in range(self.num_tokens - 1 if padded else 0):
                self.empty_pass(padded)
            return {}
        last = runner._to_device(np.asarray(last_rows))
        tokens = self.drafter.tokens(normed[last])
        drafts = [[token] for token in tokens.tolist()]
        previous = pre[last]
        # The position each draft step computes: the last kept one, then the newest token's, and on.
        position = [request.num_tokens - 2 for request in drafting]
        live = list(range(len(drafting)))
        for _ in range(self.num_tokens - 1):
            live = [i for i in live if position[i] + 1 < min(runner.max_model_len,
                                                               len(drafting[i].block_ids) * runner.block_size)]
            if not live:
                if padded is None:
                    break
                self.empty_pass(padded)
                continue
            for i in live:
                position[i] += 1
            requests = [drafting[i] for i in live]
            step_slots = np.asarray([r.block_ids[position[i] // runner.block_size] * runner.block_size
                                     + position[i] % runner.block_size for i, r in zip(live, requests)], dtype=np.int64)
            table = np.zeros((len(requests), max(len(r.block_ids) for r in requests)), dtype=np.int32)
            for row, request in enumerate(requests):
                table[row, :len(request.block_ids)] = request.block_ids
            metadata = runner._attention_metadata(len(requests), list(range(len(requests) + 1)),
                                                [position[i] + 1 for i in live], [position[i] for i in live],
                                                [table], [step_slots], [-1] * len(requests), runner._group_keys)
            live_rows = runner._to_device(np.asarray(live))
            normed, pre = self._pass(metadata, [drafts[i][-1] for i in live], [position[i] for i in live],
                                           previous[live_rows], padded)
            tokens = self.drafter.tokens(normed).tolist()
            for i, token in zip(live, tokens):
                drafts[i].append(token)
            previous[live_rows] = pre  # (an indexed copy of the first pass's states: not shared)
        return {request.request_id: d for request, d in zip(drafting, drafts)}

    def _pass(self, metadata, ids: list[int], positions: list[int], previous_hidden: torch.Tensor,
              padded: int | None = None):
        runner = self.runner
        moe = MoEStep(padded or padded_step_tokens(max(len(ids), 1), runner.step_buckets))
        with forward_context(metadata, runner.block_size, moe):
            return self.drafter.forward(runner._to_device(np.asarray(ids, dtype=np.int64)), previous_hidden,
                                        runner._to_device(np.asarray(positions, dtype=np.int64)))

    def empty_pass(self, padded: int) -> None:
        """A draft pass with nothing to draft (lockstep DP + EP): one padding row that reaches no expert and
        writes no cache, so that this rank's drafter joins the other ranks' exchanges."""
        runner = self.runner
        token = torch.zeros(1, dtype=torch.int64, device=runner.device)
        hidden = torch.zeros(1, runner.model.config.hidden_size, dtype=runner.dtype, device=runner.device)
        with forward_context(None, runner.block_size, MoEStep(padded, valid_tokens=0)):
            self.drafter.forward(token, hidden, token)


def make_draft_runner(runner, config, device: torch.device, show_progress: bool) -> DraftRunner | None:
    """The draft runner of config.speculative_config's model drafter for `runner` (its model built), or None:
    no speculation, or n-gram lookup (drafted by the engine). An EAGLE3 head becomes a submodule of the target,
    so its attention's cache is allocated with the target's."""
    spec = config.speculative_config
    if spec is None or spec.method not in ("mtp", "eagle3"):
        return None
    if spec.method == "mtp":
        drafter = MtpDraft(runner.model)
    else:
        head, layer_ids = build_eagle3(spec.model, runner.model, runner.dtype, device, show_progress)
        runner.model.eagle3 = head
        drafter = Eagle3Draft(runner.model, head, layer_ids)
    in_lockstep = bool(config.lockstep and drafter.exchanges_experts)
    return DraftRunner(runner, drafter, spec.num_speculative_tokens, in_lockstep)
