"""`xsched capture` and `xsched import`: a model or an external graph as a graph JSON."""

from __future__ import annotations

import argparse

from xsched.cli.common import add_shape_flag, parse_shape_flags, print_json


def _grad_outputs(text: str) -> str | tuple[int, ...]:
    """--grad-outputs: all, auto, or comma-separated output positions."""
    if text in ("all", "auto"):
        return text
    try:
        return tuple(int(k) for k in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"want all, auto or output positions such as 1 or 0,1; got {text!r}") from None


def cmd_capture(a: argparse.Namespace) -> int:
    from xsched.loaders import load_graph  # capturing imports torch

    shapes = parse_shape_flags(a.shape)
    g = load_graph(
        a.model,
        batch=a.batch,
        scale=a.scale,
        inference=a.inference,
        shapes=shapes,
        grad_outputs=a.grad_outputs,
        device_type=a.device_type,
    )
    if a.chunk_loss is not None:
        from xsched.capture.chunk_loss import chunked_as_asked

        g = chunked_as_asked(g, a.chunk_loss)
    g.save(a.output)
    phases = {p: sum(o.phase == p for o in g.ops) for p in ("fwd", "loss", "bwd")}
    if a.json:
        print_json(
            {
                "graph": a.output,
                "name": g.name,
                "fingerprint": g.fingerprint,
                "ops": len(g.ops),
                "values": len(g.values),
                "phases": phases,
                "chunk_loss": g.extra.get("chunk_loss"),
            }
        )
        return 0
    print(f"{g.name}: {len(g.ops)} ops ({phases}), {len(g.values)} values -> {a.output}")
    return 0


def cmd_import(a: argparse.Namespace) -> int:
    from xsched.importers import import_networkx

    g, p = import_networkx(a.file)
    g.save(a.output)
    if a.profile_out:
        p.save(a.profile_out)
    if a.json:
        print_json(
            {
                "graph": a.output,
                "profile": a.profile_out,
                "name": g.name,
                "fingerprint": g.fingerprint,
                "ops": len(g.ops),
                "input_links": sum(len(o.inputs) for o in g.ops),
            }
        )
        return 0
    print(f"{g.name}: {len(g.ops)} ops, {sum(len(o.inputs) for o in g.ops)} input links -> {a.output}")
    return 0


def add(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser("capture", help="capture a model's training (or inference) graph")
    c.add_argument(
        "model",
        help="zoo:NAME, path/to/file.py:factory returning (model, example_inputs), model.onnx (its inference graph), "
        "or a bench graph .json",
    )
    c.add_argument("--batch", type=int)
    c.add_argument("--scale", default="default", help="zoo size knob: tiny, small, default")
    c.add_argument("--inference", action="store_true", help="forward only")
    c.add_argument(
        "--grad-outputs",
        type=_grad_outputs,
        default="all",
        help="the forward outputs the backward differentiates: all (default), auto (the scalar losses, if the "
        "model returns any: loss.backward() of a (logits, loss) model) or positions, e.g. 1",
    )
    c.add_argument(
        "--chunk-loss",
        type=int,
        metavar="K",
        help="compute the cross-entropy (log_softmax + nll_loss) and its backward in K row blocks, so no "
        "[tokens, vocab] tensor but the logits is made whole: a lower memory bound for language models",
    )
    c.add_argument(
        "--device-type",
        choices=("cpu", "cuda"),
        help="the devices whose kernels run the graph (default the model's): its outputs whose dtype the device "
        "decides (a bf16 layer norm's mean and rstd are float32 on CUDA) as they make them, and dropout as they run "
        "it (CUDA's fused kernel); `xsched profile`, `report` and `train` type a captured model by their devices (a "
        "simulated GPU counts as a GPU)",
    )
    add_shape_flag(c)
    c.add_argument("-o", "--output", required=True)
    c.add_argument("--json", action="store_true")
    c.set_defaults(run=cmd_capture)

    i = sub.add_parser("import", help="import an external networkx node-link graph (Checkmate / Moccasin)")
    i.add_argument("file")
    i.add_argument("-o", "--output", required=True)
    i.add_argument("--profile-out")
    i.add_argument("--json", action="store_true")
    i.set_defaults(run=cmd_import)
