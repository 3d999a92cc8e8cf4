"""`make bench`: what each practice buys on this machine. Imported only by the CLI; the core never imports it.

    run.py          the rows (training practices, padding, kernel cache, ...), alternating on/off, bench.json + bench.md
    training.py     the training rows' measurements: a variant's loop timed, variants taking turns, second epochs
                    in fresh processes, peak memory
    decoding.py     decoding rows: int8 and 16-bit against fp32, the word rules' cost, the decoder of commit
                    9415323 against today's, summarize end to end
    memory.py       peak-memory rows, each in a fresh child process
    decoding_v1.py  the decoder of commit 9415323, frozen and self-contained: the baseline of the decoding rows
                    and of an equivalence test, never used to decode
"""
