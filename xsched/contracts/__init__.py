"""The contracts between the stages and the op encodings they rely on (docs/ARCHITECTURE.md, "Contracts"):
`graph` (contract 1), `profile` (contract 2), `plan` (contract 3), `torch_ops` and `onnx_ops` (how a graph op
is called), `random_ops` (which ops draw from the RNG, without torch). Nothing here measures, solves or executes a
plan."""
