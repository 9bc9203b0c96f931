"""The systems code around the method, which a reader of d3d.py never needs to open.

The modules form layers, each importing only from those below it:

    runtime  <-  systems/rounds.py  <-  d3d  <-  systems/  <-  toy  <-  the drivers

    runtime.py   what the method runs on: fixed-size KV caches, the round's one host read,
                 the clock, the committed tokens and a decode's stats, input checks, loading
    d3d.py       the method: drafter and mask, loss, drafting and verification, the sync and
                 async decoders, pruning, selective prefill
    rounds.py    the watchers of a decode's rounds, fed by one call a round; below d3d, which
                 makes them: it imports only runtime
    systems/     the rest of this package: each module imports only from runtime, d3d and the
                 modules here
    toy.py       the toy target the repository ships (toy-target/): its task, build and checks
    drivers      train.py, decode.py and lab.py; they never import each other

No project module imports another inside a function, where a cycle would hide.

Beside the method:
    fast.py         compiled fixed-shape decoding passes (CUDA graphs on a GPU); pruning's
                    scorer from one pass
    batched.py      concurrent requests as one ragged batch (the paper's Table 2):
                    batched.generate
    rounds.py       the watchers of a decode's rounds (above): d3d.generate's on_round and
                    streamer, and async's tally of hits and misses
    explain.py      decoding rounds told in words, from d3d.generate(on_round=...):
                    describe_round, RoundPrinter, ColoredStream
Both drivers':
    cli.py          the flags made from the settings' dataclasses (add_settings), every flag
                    checked against its range, every file a flag names (a toy target against
                    its toy.json), every path a command writes (check_output: the one rule of
                    what it may write over); one error line, exit status 2
    pictures.py     the paper's pictures drawn by the code (optional: matplotlib,
                    requirements-plots.txt)
train.py's machinery:
    train_flags.py  train.py's flags: a dataclass per --help group, beside TrainSettings and
                    d3d.D3DConfig's; the files a run reads (Inputs) and the target's answers
    drafters.py     the drafter a run starts from: a causal LM with the target's tokenizer,
                    some layers kept (build_drafter), its embeddings frozen but for MASK
    checkpoints.py  a checkpoint's recipe, checked before a rerun resumes it (resume)
    answers.py      the target's own answers to the prompts, cached as token ids, and the
                    training batches made of them
    distributed.py  process group, FSDP2 sharding/broadcast/gathering, resumable checkpoints
                    (piecewise and sharded)
    memory.py       measured peak memory, and the estimated peaks of an FSDP training step and
                    a pruning recovery step
    evaluation.py   offline tau on held-out answers, the acceptance curve, load_trained,
                    `train.py eval`
    pruning.py      `train.py prune`: progressive layer pruning, then unpruned vs pruned
                    decoding against the target
decode.py's machinery:
    decode_flags.py decode.py's flags: a dataclass per --help group, beside d3d.DecodeConfig's
    decoding.py     what a run decodes, read from its flags (Plan), the modes it names
                    (parse_mode), one prompt decoded in each (decode_prompt), the caches (prepare)
    figures.py      Table 1 from a run's records: a mode's speedup, tau, tok/s, hit rate
                    (summarise), its layout (table)
    forensics.py    the greedy check: where an output leaves target-only's, a near-tie or an
                    error (classify_divergence)
    peers.py        transformers' generate, assisted generation and prompt lookup, timed
                    beside D3D (hf_decode)
    benches.py      the benchmarks beside Table 1: concurrency (Table 2), selective prefill,
                    the sampling check
"""
