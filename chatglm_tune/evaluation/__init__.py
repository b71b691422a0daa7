"""Answering records and scoring the answers: `extraction` (infer.py as a library: prompts in, rows and scores out),
`shards` (extraction split among processes, their parts merged), `metrics` (triple P/R/F1), `textmetrics` (BLEU-4 /
ROUGE, the official P-tuning scores) and `callmetrics` (tool-call accuracy). An upper room: it imports the shared
rooms (`data`, `decoding`, `runtime`), never `runs`, `tuning` or a command line."""
