"""Context parallelism: the ranks of a cp group share each sequence (shared by tp-attention's
study and the trainer's `train.cp`).

    sharding.py  zigzag shards: rank r holds chunks r and 2cp-1-r of 2·cp, positions for the
    embeddings exchange.py  the ring's send/receive and Ulysses' all-to-all, counted
    (dtrain.parallel.comm_counter),
                 and the analytic volume they must equal
    ring.py      ring attention (pass-KV, online-softmax merge, load-balanced causal blocks),
                 forward and backward by hand
    ulysses.py   all-to-all attention: sequence shard <-> head shard
    trainer_cp.py  the trainer's side: checks, implementation choice (ring | ulysses | PyTorch's
                 context_parallel), the attention core swap (swap_attention_cores), each
                 micro-batch's shard
"""
