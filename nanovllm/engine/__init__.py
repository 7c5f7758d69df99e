"""One engine replica: a request's walk from prompt to output.

processor.py turns prompts into Requests of Sequences (nanovllm/sequence.py) and their state into
RequestOutputs; core.py's EngineCore runs steps: the Scheduler (scheduler.py) picks each step's
tokens within its budget, the BlockManager (block_manager.py) gives them paged KV blocks and
prefix-cache hits, the ModelRunner (model_runner.py) plans the step's inputs (step_inputs.py),
runs the forward (replaying cuda_graphs.py for decode) over the KV cache (kv_cache.py) and samples
with its StepSampler (nanovllm/sampling), with LoRA adapters in their slots (lora_manager.py);
detokenizer.py grows the text token by token and stop_checker.py decides when a sequence ends.
base.py is the interface that LLM drives, which the executors implement.
"""
