"""One instance over several ranks: tensor, expert and chunked-pipeline parallelism.

``shape`` (the ranks and what each holds), ``shard`` (the slice of every weight a rank keeps),
``comm`` (the collectives the forward passes call). The rank-0 face and its followers live in
``engine.parallel.group`` and ``engine.parallel.follower``. Importing this package imports no
process-group machinery; nothing here starts processes.
"""
