"""`python -m tp_attention`: hand-rolled tensor-parallel attention vs DTensor vs one rank.

python -m tp_attention                                  # tp=world_size=2 on CPU, SP off and on
python -m tp_attention world_size=4 tp=[1,2,4] model.seq_len=512
python -m tp_attention -m model.n_kv_head=2,8 sequence_parallel=false,true
python -m tp_attention.parity                           # prove it equal to one device first
"""

from dtrain.run.app import hydra_main

# named, not imported: a wrong override is refused before torch and the rank code load
# (dtrain.run.app.resolve)
main = hydra_main(
    "tp_attention.conf",
    rank_fn="tp_attention.bench:rank_fn",
    validate="tp_attention.config:check_bench",
    finalize="tp_attention.report:finalize",
)

if __name__ == "__main__":
    main()
