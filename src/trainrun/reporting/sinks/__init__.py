"""Where metrics go: one module per sink, each the only code that writes its files.

Every sink takes one step's metrics as plain Python floats through one small protocol
(``writer.Writer``: ``write`` and ``close``): ``metrics.jsonl`` always (``jsonl.py``),
TensorBoard event files, on by default (``tensorboard.py``), Weights & Biases when installed and
asked for (``wandb.py``). ``RunOutput`` (``reporting/run_output.py``) fans a window of rows
out to them and to the console; only process 0 of a multi-process run builds any of them.

The loop reads metrics as tables, a window of consecutive steps at a time (``Table``). A sink
that also has ``write_table`` takes the whole table at once: the JSONL and TensorBoard sinks
format it from a template made once per set of names, since on a fast step writing is a large
part of what the loop costs (BENCHMARKS.md, "Writing metrics").
"""
