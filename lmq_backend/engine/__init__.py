"""The engine: the model's work for every query at once, over the prefix cache.

    engine.py     `Engine`: runner, K/V store, prefix cache and scheduler, built in one place
    scheduler.py  `Scheduler`: the step loop (schedule -> run -> post-process), continuous batching
    admission.py  which waiting prefills a step runs, and when they join the running rows
    rows.py       the scheduler's records: `PrefillRequest`, `Row` (and its next `Decode`), `Batch`
    runner.py     `ModelRunner`: batched prefill and decode forwards over the rows' page tables
    kv_pool.py    `KVPool`: the running rows as page tables into the K/V store
    picks.py      picking tokens: `Draw`, `Choices`, the samplers; `picks_cpu.py`, `picks_gpu.py` per device
    attention.py  attention for the model's own forwards; compat.py: transformers' caches over the pool
    fused/        the fused Llama-family step and prefill (kernels: `lmq_kernels`)
    quantize.py   weight-only int8 / int4 linear layers on the CPU
"""
