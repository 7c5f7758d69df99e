"""The building blocks of the models: tensor-parallel linear layers and embeddings (linear.py,
embed_head.py, given their TensorParallel rank and size when built), norms, activation, the rotary
embedding, paged attention and its backends (attention/), and the sampler with its Triton kernels.
"""
