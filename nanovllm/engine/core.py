"""One engine replica's loop: requests in, a Scheduler and BlockManager deciding each step, a
ModelRunner running it, finished RequestOutputs out. executor/llm_engine.py's LLMEngine is this
loop with its tensor-parallel workers started."""
import logging
import sys
from collections.abc import Iterable
from dataclasses import replace

from nanovllm.config import Config
from nanovllm.engine.base import EngineBase
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.model_runner import LaunchedStep, ModelRunner
from nanovllm.engine.processor import Processor, Request
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.spec_decode import SpecDecodeMetrics, Speculator, make_proposer
from nanovllm.sampling.warmup import warm_up_sampler
from nanovllm.sequence import PLACEHOLDER, Sequence, SequenceStatus
from nanovllm.engine.stop_checker import check_stop
from nanovllm.engine.trace import region
from nanovllm.lora.request import LoRARequest
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)
STALE = sys.maxsize  # the position of a row whose token followed tokens cut since: past any sequence's end


class EngineCore(EngineBase):
    """One replica. workers: with tensor_parallel_size > 1, the other ranks' processes (rank 0's
    handle on them, executor/tp_workers.py), which this process drives as rank 0."""

    def __init__(self, config: Config, workers=None):
        spec = config.speculative_config
        proposer = make_proposer(config) if spec else None  # a draft model's memory first: the KV cache gets the rest
        self.model_runner = runner = ModelRunner(config, workers=workers, aux_layers=proposer.aux_layers if spec else ())
        if spec:
            proposer.bind(runner)
        if runner.device.type == "cuda":  # every sampling kernel compiled now, not inside a generate call
            warm_up_sampler(config.logprobs_mode, config.hf_config.vocab_size, runner.dtype, runner.device)
        if self.model_runner.max_model_len < config.max_model_len:
            logger.warning("max_model_len lowered from the model's %d to %d tokens, what the KV cache holds "
                           "(set max_model_len, or give the cache more memory)", config.max_model_len,
                           self.model_runner.max_model_len)
            config = replace(config, max_model_len=self.model_runner.max_model_len)
        self.config = config
        self.processor = Processor(config)
        self.block_manager = BlockManager(self.model_runner.num_kvcache_blocks, config.kvcache_block_size,
                                          config.enable_prefix_caching)
        self.scheduler = Scheduler(config.max_num_seqs, config.max_num_batched_tokens, self.block_manager,
                                   config.max_loras if config.enable_lora else 0)
        self.requests: dict[str, Request] = {}  # the unfinished ones
        self._inflight: tuple[LaunchedStep, list[int]] | None = None  # launched step, each row's PLACEHOLDER index
        self.num_prefill_tokens = self.num_decode_tokens = 0  # of the last step
        self.spec_metrics = SpecDecodeMetrics(spec.num_speculative_tokens if spec else 0)  # every verify run's
        self.speculator = Speculator(config, proposer, self.spec_metrics, uniform=runner.graph_runner is not None) \
            if spec else None

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                    arrival_time: float | None = None, lora_request: LoRARequest | None = None,
                    priority: int = 0) -> None:
        """Queue one request (vLLM's LLMEngine.add_request), run with the LoRA adapter lora_request
        when given; its outputs come from step() as its params.output_kind says. ValueError,
        nothing queued, when it is invalid or the id is in use."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use by an unfinished request")
        request = self.processor.make_request(request_id, prompt, params or SamplingParams(), lora_request, priority,
                                              arrival_time)
        self.requests[request_id] = request
        self.scheduler.add(request.seqs[0])

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Drop unfinished requests by id (unknown ids are ignored) and free their KV blocks."""
        aborted = set()
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            request = self.requests.pop(rid, None)
            for seq in request.seqs if request else ():
                aborted.add(seq.seq_id)
                if not seq.is_finished:
                    self.scheduler.finish(seq, "abort")
        if aborted and self._inflight is not None:  # its rows are read after the id may name a new request
            launched, positions = self._inflight
            for row, seq in enumerate(launched.seqs):
                if seq.seq_id in aborted:
                    positions[row] = STALE
            if launched.prompt_logprobs is not None:
                spans = launched.prompt_logprobs[0]
                spans[:] = [(None if seq.seq_id in aborted else seq, first, count) for seq, first, count in spans]

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or self._inflight is not None

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def abort_all_requests(self):
        """Drop every unfinished request, freeing its KV blocks (finish_reason "abort")."""
        self.model_runner.synchronize()
        for seq in self.scheduler.abort_all():
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
        self.requests.clear()
        self._inflight = None
        self.model_runner.reset()

    def reset_prefix_cache(self) -> bool:
        return self.block_manager.reset_prefix_cache()

    def add_lora(self, lora_request: LoRARequest) -> bool:
        self._check_lora_enabled("add_lora")
        self.processor.check_lora(lora_request)
        self.model_runner.lora_call("add", lora_request)
        return True

    def remove_lora(self, lora_id: int) -> bool:
        self._check_lora_enabled("remove_lora")
        return self.model_runner.lora_call("remove", lora_id)

    def list_loras(self) -> set[int]:
        self._check_lora_enabled("list_loras")
        return set(self.model_runner.lora.host)

    def pin_lora(self, lora_id: int) -> bool:
        self._check_lora_enabled("pin_lora")
        self.model_runner.lora_call("pin", lora_id)
        return True

    def get_metrics(self) -> list:
        """The speculative decoding counters since the engine started (engine/spec_decode/metrics.py)."""
        return self.spec_metrics.metrics()

    def step(self) -> list[RequestOutput]:
        """Schedule and launch one step, then finish the previous one.

        Steps overlap (as vLLM's async scheduling): the step launched here runs on the GPU while
        the host reads the previous step's sampled tokens, checks stop conditions and schedules
        the next step. A token that is sampled but not yet read sits in its sequence as
        PLACEHOLDER and the next step takes its value straight from the GPU. A sequence that
        stopped is found one step late; the one extra token computed for it is dropped.
        A speculative step (speculative_config) reads the step in flight first and proposes drafts
        from every known token (engine/spec_decode/speculator.py says why).
        """
        outputs = []
        speculate = self.speculator is not None and self.speculator.active(self.scheduler)
        # a step after verify runs waits for them too: a plain row of theirs would follow k + 1
        # tokens still on the device, of which the grammar's mask (structured outputs) needs them all
        if self._inflight is not None and (speculate or self._inflight[0].runs):
            previous, self._inflight = self._inflight, None
            outputs = self._process(*previous)
        if speculate:
            with region("propose"):
                self.speculator.propose(self)
        with region("scheduling"):
            scheduled = self.scheduler.schedule()
        prefill = [n for seq, n in scheduled if seq.num_computed_tokens - n < seq.num_prompt_tokens]
        drafts = self.scheduler.scheduled_drafts
        self.num_prefill_tokens = sum(prefill)
        self.num_decode_tokens = len(scheduled) - len(prefill) + sum(map(len, drafts.values()))
        forks, copies = self._fork(scheduled)
        launched = self.model_runner.run(scheduled, forks, copies, drafts) if scheduled else None
        previous, self._inflight = self._inflight, self._after_launch(launched) if launched else None
        return outputs + self._process(*previous) if previous else outputs

    def _fork(self, scheduled) -> tuple[dict, list]:
        """For a request with n > 1, the other n - 1 completions start when its prompt is computed:
        from the same KV blocks and the same logits (so the prompt is prefilled once). Returns
        (seq_id -> the children forked from it this step, the KV block copies they need)."""
        forks, copies = {}, []
        for seq, _ in scheduled:
            if seq.num_forks and seq.num_computed_tokens == len(seq):
                request = self.requests[seq.request_id]
                for index in range(1, seq.num_forks + 1):
                    child = self.processor.new_sequence(request, index)
                    request.seqs.append(child)
                    forked, copy = self.scheduler.fork(seq, child)
                    if forked:
                        forks.setdefault(seq.seq_id, []).append(child)
                    if copy:
                        copies.append(copy)
                seq.num_forks = 0
        return forks, copies

    def add_draft_tokens(self, seq: Sequence, draft_token_ids: list[int]) -> int:
        """Have `seq`, a decoding sequence, verify draft tokens in its next step (speculative
        decoding's seam): that step runs its last token and the k drafts and samples 1 + k
        positions, whose tokens join seq up to the first that differs from the draft at its
        position (what followed a wrong draft is dropped, with its KV: BlockManager.truncate), or
        up to a stop. Returns how many drafts it takes: those that leave its last token before
        max_tokens and max_model_len to a plain step, and fit in a step (max_num_batched_tokens);
        0 where seq cannot verify drafts now (not decoding: in prefill, preempted or finished; or
        with logits processors whose state follows one sampled row per sequence: penalties,
        min_tokens, ...; a structured output's grammar masks each draft's row itself).
        ValueError, nothing taken, for ids outside the vocabulary or a sequence with drafts already."""
        vocab_size = self.config.hf_config.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab_size for t in draft_token_ids):
            raise ValueError(f"draft token ids must be integers in [0, {vocab_size}), got {draft_token_ids!r}")
        if seq.seq_id in self.scheduler.drafts:
            raise ValueError(f"sequence {seq.seq_id} already has draft tokens for its next step")
        room = self.draft_room(seq)
        if room <= 0 or not draft_token_ids:
            return 0
        self.scheduler.drafts[seq.seq_id] = taken = list(draft_token_ids[:room])
        return len(taken)

    def draft_room(self, seq: Sequence) -> int:
        """How many drafts seq can verify in its next step (add_draft_tokens takes at most this many);
        0 or less where it can take none."""
        cfg, sp = self.config, seq.sampling_params
        if seq.status != SequenceStatus.RUNNING or seq.num_computed_tokens != len(seq) - 1 or not sp.takes_drafts:
            return 0
        limit = cfg.max_model_len if sp.max_tokens is None else min(cfg.max_model_len,
                                                                     seq.num_prompt_tokens + sp.max_tokens)
        return min(limit - len(seq) - 2, cfg.max_num_batched_tokens - 1)  # after the run, one token to go at least

    def _after_launch(self, launched: LaunchedStep) -> tuple[LaunchedStep, list[int]]:
        """One PLACEHOLDER per sampled row (a verify run's: one per position, in order);
        sequences that reach their length end now, whatever they sample (their blocks are
        reused only by later, stream-ordered steps), unless a verify run of theirs is in flight
        (the previous step's, not yet checked: it may yet be cut short); then _process ends them.
        A verify run never reaches the length itself (add_draft_tokens)."""
        previous = self._inflight[0].runs if self._inflight is not None else ()
        verifying = {seq.seq_id for seq, _, _ in previous} if previous else ()
        positions = []
        for seq in launched.seqs:
            positions.append(len(seq))
            seq.token_ids.append(PLACEHOLDER)
            if (check_stop(seq, PLACEHOLDER, len(seq), self.config.eos_token_ids, self.config.max_model_len)
                    and seq.seq_id not in verifying):
                self.scheduler.finish(seq, "length")
        return launched, positions

    def _process(self, launched: LaunchedStep, positions: list[int]) -> list[RequestOutput]:
        """Read a launched step's sampled tokens, put them in place, finish stopped sequences and
        report the requests that changed."""
        changed: dict[str, Request] = {}
        tokens = self.model_runner.read_tokens(launched)
        if launched.runs:
            self._accept_runs(launched.runs, positions, tokens)
        # a position's logprobs stay in the step's arrays, (arrays, row), until reported (Processor._logprobs)
        arrays = launched.logprobs.numpy() if launched.logprobs is not None else None
        chosen = arrays[1][:, 0].tolist() if arrays is not None else None
        row = -1  # the step's logprob rows are its sampled rows that asked for logprobs, in order
        requests, eos_token_ids, max_model_len = self.requests, self.config.eos_token_ids, self.config.max_model_len
        for seq, pos, token in zip(launched.seqs, positions, tokens):  # the hot loop: one pass per sampled row
            sp = seq.sampling_params
            row += sp.logprobs is not None
            request = requests.get(seq.request_id)
            if request is None or pos >= len(seq.token_ids):
                continue  # aborted, or stopped at an earlier token: this one was extra
            seq.token_ids[pos] = token
            if sp.logprobs is not None:
                seq.logprobs.append((arrays, row))
                seq.cumulative_logprob += chosen[row]
            new_text = seq.detokenizer.add(token) if seq.detokenizer else ""
            stop = check_stop(seq, token, pos + 1, eos_token_ids, max_model_len, new_text)
            if stop:  # tokens past it go: after a stop; past the length where it was found late (_after_launch)
                del seq.token_ids[pos + 1:]
                if stop[0] == "stop" or seq.status != SequenceStatus.FINISHED:
                    self.scheduler.finish(seq, stop[0])
                    seq.stop_reason = stop[1]
            if seq.status == SequenceStatus.RUNNING:
                self.block_manager.cache_full_blocks(seq, pos + 1)
            elif seq.status == SequenceStatus.FINISHED:
                changed[request.request_id] = request
            if sp.output_kind != RequestOutputKind.FINAL_ONLY:
                changed[request.request_id] = request
        if launched.prompt_logprobs is not None:
            self._add_prompt_logprobs(*launched.prompt_logprobs, changed)
        outputs = []
        for request in changed.values():
            if (out := self.processor.output(request)) is not None:
                outputs.append(out)
            if request.finished:
                del self.requests[request.request_id]
                for seq in request.seqs if self.speculator else ():
                    self.speculator.finished(seq)
        return outputs

    def _accept_runs(self, runs: list[tuple], positions: list[int], tokens: list[int]):
        """Cut each verify run (sequence, first row, drafts) after its first token that differs from
        the draft at its position: the later tokens followed a wrong draft, and so did the KV from
        that position on (truncated), and the rows of the step launched since (in flight) for that
        sequence, which are marked stale. The tokens kept then fill in as every row's, stops included.
        Each run checked counts in spec_metrics."""
        cut = set()
        forced_acceptance = self.speculator.proposer.forced_acceptance if self.speculator else lambda seq: None
        for seq, first, drafts in runs:
            if seq.is_finished or positions[first] >= len(seq.token_ids):
                continue  # finished, or a stale run (it followed tokens cut since)
            if (forced := forced_acceptance(seq)) is not None:  # synthetic: the drafts stand for the target's tokens
                forced = min(forced, len(drafts))
                tokens[first:first + forced] = drafts[:forced]
            for j, draft in enumerate(drafts):
                if tokens[first + j] != draft:
                    pos = positions[first + j]
                    del seq.token_ids[pos + 1:]
                    self.block_manager.truncate(seq, pos)
                    cut.add(seq.seq_id)
                    break
            else:
                j = len(drafts)
            self.spec_metrics.record(len(drafts), j)
        if cut and self._inflight is not None:
            later, later_positions = self._inflight
            for row, seq in enumerate(later.seqs):
                if seq.seq_id in cut:
                    later_positions[row] = STALE

    def _add_prompt_logprobs(self, spans: list, logprobs, changed: dict):
        """Append each span's prompt logprobs to its request, once: a prompt recomputed after a
        preemption (or by a completion that could not fork) gives positions already there."""
        arrays, row = logprobs.numpy(), 0
        for seq, first, count in spans:
            request = self.requests.get(seq.request_id) if seq is not None else None  # None: aborted
            for pos in range(first + 1, first + count + 1):
                if request is not None and pos == len(request.prompt_logprobs):
                    request.prompt_logprobs.append((arrays, row))
                row += 1
            if request is not None:
                changed[request.request_id] = request
