"""Context parallelism: the ranks of a cp group share each sequence (shared by tp-attention's
study and the trainer's `train.cp`).

    sharding.py  zigzag shards: rank r holds chunks r and 2cp-1-r of 2·cp, positions for the embeddings
    comm.py      the ring's send/receive and Ulysses' all-to-all, counted (dtrain.parallel.comm),
                 and the analytic volume they must equal
    ring.py      ring attention (pass-KV, online-softmax merge, load-balanced causal blocks),
                 forward and backward by hand
    ulysses.py   all-to-all attention: sequence shard <-> head shard
    apply.py     the trainer's side: checks, implementation choice (ring | ulysses | PyTorch's
                 context_parallel), the attention core swap, each micro-batch's shard
"""
