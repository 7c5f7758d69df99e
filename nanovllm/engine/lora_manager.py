"""Adapters in the device's slot table and in a host cache, and each step's LoRA mapping.

Every tensor-parallel rank has a LoRAManager over its model's LoRA layers (layers/lora.py).
Rank 0 plans each step (plan): the scheduler admits at most max_loras adapters among running
sequences, and each gets a slot, least recently used slots given up first (never one the step
uses); the plan's loads say which adapters to copy into which slots before the forward, and every
rank copies its own shards (begin_step) from its host cache of max_cpu_loras adapters (least
recently used out first, never a pinned one; read from disk when missing), laid out as the slots
are, so that a load is two copies per layer. A slot's copies are queued on the stream after the
previous step's forward, which may still read the slot's former adapter. The host cache's tensors
are pinned on CUDA: copies from them do not wait for the device. The engine's add_lora,
remove_lora and pin_lora change every rank's host cache alike, in order with the steps (add,
remove, pin; ModelRunner.lora_call), so the ranks' caches hold the same adapters.
"""
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from nanovllm.config import Config
from nanovllm.layers.linear import LinearBase
from nanovllm.layers.linear_method import LinearMethod
from nanovllm.layers.lora import (GRAPH_BLOCK_M, PREFILL_BLOCK_M, PREFILL_MIN_ROWS, LoRAContext, LoRALinearMethod,
                                  add_lora_weights, lora_mapping)
from nanovllm.loader.lora import lora_targets, load_adapter
from nanovllm.lora.request import LoRARequest
from nanovllm.sequence import Sequence


@dataclass
class LoRAStep:
    """A step's adapters, planned on rank 0 and sent with its StepPlan to every rank. loads: (slot,
    adapter) to copy before the forward; index, num_tiles, groups: layers/lora.py lora_mapping's;
    block_m: its tiles' most rows; kinds: the LoRA layers the step's adapters change."""
    loads: list[tuple[int, LoRARequest]]
    index: np.ndarray
    num_tiles: int
    groups: np.ndarray
    block_m: int
    kinds: frozenset


@dataclass
class HostAdapter:
    """An adapter as this rank's slots hold it: layer name -> (A [S * R, in], B [out, R] scaled),
    for the layers it changes, and those layers' kinds."""
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    kinds: frozenset


class LoRAManager:
    """The adapters of one rank's model (see the module docstring): wrap gives the model's linear
    layers their method, attach their slot tables once the model is loaded."""

    def __init__(self, config: Config):
        self.dtype, self.max_loras, self.max_rank = config.dtype, config.max_loras, config.max_lora_rank
        self.max_cpu_loras = config.max_cpu_loras
        # the Triton kernels on CUDA, and in Triton's interpreter with the Triton attention backend on CPU
        self.context = LoRAContext(self.max_loras, config.device.type == "cuda" or config.attention_backend == "triton")
        self.targets = lora_targets(config.hf_config)
        self.layers: dict[str, LinearBase] = {}
        self.pinned = config.device.type == "cuda"
        self.slots: OrderedDict[int, int] = OrderedDict()  # rank 0: adapter id -> slot, least recently used first
        self.kinds: dict[int, frozenset] = {}  # rank 0: adapter id -> its layers' kinds, for adapters in slots
        self.host: OrderedDict[int, HostAdapter] = OrderedDict()
        self.pins: set[int] = set()  # adapter ids the host cache keeps whatever their use (pin), all in it

    def wrap(self, method: LinearMethod) -> LoRALinearMethod:
        """The method of every linear layer: `method`'s products and the step's adapters' deltas."""
        return LoRALinearMethod(method, self.context)

    def attach(self, model: nn.Module):
        """Give every linear layer of `model` built with wrap's method its empty slot table (not a
        mixture of experts' router, which keeps its own method: loader/lora.py lora_targets)."""
        for name, module in model.named_modules():
            if isinstance(module, LinearBase) and isinstance(module.quant_method, LoRALinearMethod):
                add_lora_weights(module, name.rsplit(".", 1)[1], self.max_loras, self.max_rank, self.dtype)
                module.lora_index = len(self.layers)
                self.layers[name] = module
        self.context.all_kinds = frozenset(layer.lora_kind for layer in self.layers.values())
        self.context.init_one_row(len(self.layers), self.max_rank, next(iter(model.parameters())).device)

    # ---- rank 0 ------------------------------------------------------------------------------

    def plan(self, scheduled: list[tuple[Sequence, int]], graph_shape: bool) -> LoRAStep | None:
        """The LoRAStep of a step of these (sequence, new tokens), in their token order; None when no
        sequence runs an adapter. graph_shape: a step of a shape CUDA graphs run (decode, or a q_len
        with graphs): its tiles are the graphs' size, and padded to their count when captured."""
        requests = [seq.lora_request for seq, _ in scheduled]
        if not any(requests):
            return None
        step = {r.lora_int_id: r for r in requests if r is not None}
        loads = []
        for adapter_id, request in step.items():
            if adapter_id in self.slots:
                self.slots.move_to_end(adapter_id)
                continue
            kinds = self._host_adapter(request).kinds  # read (or fail) before any slot changes hands
            if len(self.slots) < self.max_loras:  # a free slot: any, once remove has freed one
                slot = min(set(range(self.max_loras)) - set(self.slots.values()))
            else:  # the least recently used slot of an adapter this step does not run (the scheduler leaves one)
                victim = next(a for a in self.slots if a not in step)
                slot = self.slots.pop(victim)
                del self.kinds[victim]
            self.slots[adapter_id] = slot
            self.kinds[adapter_id] = kinds
            loads.append((slot, request))
        seq_slots = np.array([-1 if r is None else self.slots[r.lora_int_id] for r in requests], np.int64)
        counts = np.fromiter((n for _, n in scheduled), np.int64, len(scheduled))
        token_slots = np.repeat(seq_slots, counts)
        num_rows = int((token_slots >= 0).sum())
        block_m = PREFILL_BLOCK_M if not graph_shape and num_rows > PREFILL_MIN_ROWS else GRAPH_BLOCK_M
        pad = self.context.graph_tiles if graph_shape and self.context.graph_index is not None else None
        index, num_tiles, groups = lora_mapping(token_slots, block_m, pad)
        return LoRAStep(loads, index, num_tiles, groups, block_m, frozenset().union(*(self.kinds[a] for a in step)))

    def forget_slots(self):
        """Treat every slot as empty (after an aborted step, which may have planned loads it never
        made): later steps load their adapters anew."""
        self.slots.clear()
        self.kinds.clear()

    # ---- every rank --------------------------------------------------------------------------

    @staticmethod
    def host_arrays(step: LoRAStep | None) -> dict[str, np.ndarray]:
        """The arrays the Stager uploads with the step's plan: the mapping, when the step has one."""
        return {} if step is None else {"lora_index": step.index}

    def begin_step(self, step: LoRAStep | None, tensors: dict[str, torch.Tensor]):
        """Before a forward: copy the step's new adapters into their slots and set the LoRAContext
        (tensors: the step's uploaded arrays, host_arrays' among them)."""
        if step is None:
            self.context.clear()
            return
        for slot, request in step.loads:
            weights = self._host_adapter(request).weights
            for name, layer in self.layers.items():
                a, b = weights.get(name, (None, None))
                if a is None:  # steps of this adapter with another that changes the layer read its slot
                    layer.lora_a[slot].zero_()
                    layer.lora_b[slot].zero_()
                else:
                    layer.lora_a[slot].copy_(a, non_blocking=True)
                    layer.lora_b[slot].copy_(b, non_blocking=True)
        self.context.set_step(tensors["lora_index"], step.num_tiles, step.block_m, step.groups, step.kinds)

    def add(self, request: LoRARequest):
        """Read the adapter into the host cache now, as a step that runs it would (kept there as
        most recently used). ValueError from check_adapter for a bad adapter, or when every
        adapter in the cache is pinned (none can leave for it)."""
        self._host_adapter(request)
        if request.lora_int_id not in self.host:
            raise ValueError(f"LoRA adapter {request.lora_name!r} (lora_int_id {request.lora_int_id}) cannot be kept: "
                             f"all max_cpu_loras={self.max_cpu_loras} adapters of the host cache are pinned; "
                             f"remove_lora one, or raise max_cpu_loras")

    def remove(self, lora_id: int) -> bool:
        """Drop the adapter from the host cache, with its pin, and (rank 0) free its slot: a later
        step of a request that runs it reads it again from disk into a free slot. Whether it was
        in the cache or a slot."""
        in_slot = self.slots.pop(lora_id, None) is not None
        self.kinds.pop(lora_id, None)
        self.pins.discard(lora_id)
        return self.host.pop(lora_id, None) is not None or in_slot

    def pin(self, lora_id: int):
        """Keep the adapter in the host cache until remove: the least recently used adapter that
        leaves for another is never a pinned one. ValueError naming the id when it is not there."""
        if lora_id not in self.host:
            raise ValueError(f"LoRA adapter lora_int_id {lora_id} is not loaded (list_loras() gives those that are); "
                             f"add_lora it first")
        self.pins.add(lora_id)

    def _host_adapter(self, request: LoRARequest) -> HostAdapter:
        """The adapter from the host cache, read from disk (and the cache's least recently used one
        dropped) when it is not there."""
        adapter = self.host.get(request.lora_int_id)
        if adapter is not None:
            self.host.move_to_end(request.lora_int_id)
            return adapter
        info, tensors = load_adapter(request, self.targets, self.max_rank)
        rank, weights = self.max_rank, {}
        for module, (a_full, b_full) in tensors.items():
            target = self.targets[module]
            layer = self.layers[target.layer]
            if target.layer not in weights:
                weights[target.layer] = (torch.zeros(layer.lora_a.shape[1:]), torch.zeros(layer.lora_b.shape[1:]))
            a, b = weights[target.layer]
            a_pad = torch.zeros(rank, a_full.size(1))
            a_pad[:info.rank] = a_full
            b_pad = torch.zeros(b_full.size(0), rank)
            b_pad[:, :info.rank] = b_full * info.scale
            rows = a[target.index * rank:(target.index + 1) * rank]
            if layer.tp_dim == 1:  # row-parallel: A split along its input as the layer's weight, B whole
                layer.weight_loader(rows, a_pad)
                b.copy_(b_pad)
            else:  # column-parallel: A whole, B's rows split as the layer's weight's
                rows.copy_(a_pad)
                layer.weight_loader(b, b_pad, target.shard)
        adapter = HostAdapter(self._keep(weights), frozenset(self.layers[name].lora_kind for name in weights))
        self.host[request.lora_int_id] = adapter
        while len(self.host) > self.max_cpu_loras:  # pinned ones stay: with all others pinned, this one goes
            del self.host[next(a for a in self.host if a not in self.pins)]
        return adapter

    def _keep(self, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, tuple[torch.Tensor, ...]]:
        """weights in the model's dtype, as views of one buffer: pinned on CUDA, where each pinned
        allocation costs a synchronization with the device (one per adapter, not one per tensor)."""
        flat = torch.empty(sum(t.numel() for pair in weights.values() for t in pair), dtype=self.dtype,
                           pin_memory=self.pinned)
        kept, start = {}, 0
        for name, pair in weights.items():
            views = []
            for t in pair:
                views.append(flat[start:start + t.numel()].view(t.shape).copy_(t))
                start += t.numel()
            kept[name] = tuple(views)
        return kept
