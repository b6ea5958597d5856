"""``lynx-hf`` command line (also ``python -m lynx_hf``).

Subcommands: ``generate`` (patch + generate on a local checkpoint; default the committed fixture A, package data
of ``lynx_hf.eval``), ``tune`` (the cost gate's decision table of a checkpoint on this device), ``plot``,
``vllm-stats``; ``eval | sweep | bench | report`` run the installed
``lynx_hf.eval`` modules (``python -m lynx_hf.eval.harness | sweep | bench | router_report``).
Errors are one clear line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import fields
from pathlib import Path

import lynx_hf  # its public functions, looked up when called (tests replace lynx_hf.patch)

from .config import GATE_ENV, LynxConfig, field_help, field_types
from .eval import DEFAULT_FIXTURE as DEFAULT_MODEL  # package data of lynx_hf.eval
from .eval import PROMPTS_FILE as DEFAULT_PROMPTS
from .gate import STORE, DecisionTable, off_line
from .gate import of as gate_of
from .telemetry import layer_table


class CliError(Exception):
    """A user error reported as one line."""


def _policy_args(parser: argparse.ArgumentParser) -> None:
    """One ``--field`` option per :class:`LynxConfig` field (derived from the dataclass: a new field is a
    new option; its help is the first sentence of the field's entry in the docstring, ``config.field_help``); values
    are parsed by :meth:`LynxConfig.from_options` (``None``, numbers, true/false; ``--gate`` left out: ``LYNX_HF_GATE``
    where set, :meth:`LynxConfig.from_environment`)."""
    types = field_types()
    for f in fields(LynxConfig):
        base, optional = types[f.name]
        kind = base.__name__ + (" or None" if optional else "")
        default = repr(f.default) + (f", or ${GATE_ENV} where set" if f.name == "gate" else "")
        metavar = "BOOL|counts" if f.name == "telemetry" else kind.upper().replace(" ", "_")
        parser.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, default=argparse.SUPPRESS, metavar=metavar,
                            help=f"{field_help(f.name)} (LynxConfig.{f.name}; default {default})".replace("%", "%%"))


def _config(args):
    options = {f.name: getattr(args, f.name) for f in fields(LynxConfig) if getattr(args, f.name, None) is not None}
    # options override the file; fields neither names: LynxConfig.from_environment (gate from LYNX_HF_GATE)
    base = LynxConfig.from_file(args.config) if getattr(args, "config", None) else None
    return LynxConfig.from_options(options, base=base)


def _load(model_path: Path, dtype: str):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # keep stderr for our own messages
    if not model_path.is_dir() or not (model_path / "config.json").is_file():
        raise CliError(f"no local checkpoint at {model_path} (a folder with config.json is expected)")
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    # "auto": the checkpoint's own dtype, as from_pretrained loads it by default
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype if dtype == "auto" else getattr(torch, dtype))
    return model.eval(), tokenizer


def cmd_generate(args) -> int:
    import torch

    cfg = _config(args)  # validate options before loading anything
    for name in ("batch_size", "max_new_tokens"):
        if getattr(args, name) < 1:
            raise CliError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    model, tokenizer = _load(Path(args.model), args.dtype)
    prompts = [line.rstrip("\n") for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    if not prompts:
        raise CliError(f"no prompts in {args.prompts}")
    distinct = len(prompts)
    prompts = (prompts * ((args.batch_size + len(prompts) - 1) // len(prompts)))[: args.batch_size]
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    gen = dict(max_new_tokens=args.max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    try:
        lynx_hf.patch(model, cfg)
    except lynx_hf.LynxError as exc:
        raise CliError(str(exc)) from exc
    with torch.inference_mode():
        with lynx_hf.patched(model, policy="none"):
            reference = model.generate(**batch, **gen)
        lynx_hf.reset_stats(model)
        output = model.generate(**batch, **gen)
    summary = lynx_hf.stats(model).summary()
    prompt_len = batch["input_ids"].shape[1]
    new_ref, new_out = reference[:, prompt_len:], output[:, prompt_len:]
    agreement = (new_ref == new_out).float().mean().item()
    exact = (new_ref == new_out).all(dim=1).float().mean().item()

    skipped = summary.get("gate_steps_skipped", 0)
    repeats = f" ({distinct} distinct prompts, repeated)" if len(prompts) > distinct else ""
    print(f"model: {args.model}  policy: {cfg.policy}  batch: {len(prompts)}{repeats}  new tokens: {args.max_new_tokens}"
          f"  decode steps: {summary['decode_steps']}"
          + (f" (the cost gate kept the model's routing on {skipped} MoE layer-steps: layers x decode steps)"
             if skipped else ""))
    print_layer_table(summary, summary["per_layer"])
    gated = off_line(summary["per_layer"])  # the cost gate switched the policy off somewhere (LynxConfig.gate)
    if gated:
        print(gated)
    print(f"token agreement with unpatched greedy decode: {agreement:.3f}; identical continuations: {exact:.3f}")
    if not args.quiet:
        for prompt, row in zip(prompts, new_out):
            text = tokenizer.decode(row, skip_special_tokens=True)  # repr() below shows newlines as \n
            print(f"--- {prompt!r} -> {text!r}")
    if args.stats_json:
        import json

        Path(args.stats_json).write_text(json.dumps(summary, indent=2))
    return 0


def cmd_tune(args) -> int:
    """Measure the cost gate's decisions (``gate="auto"``) for every MoE layer of a checkpoint on this device, once
    per distinct key, and add them to the table ``--out`` (created, or merged into: other entries stay). The table is
    what ``LynxConfig(gate_table=...)`` / ``--gate-table`` reads first; the per-user cache is refreshed too."""
    import dataclasses
    import time

    import torch

    cfg = dataclasses.replace(_config(args), gate="auto", gate_table=None)
    out = Path(args.out)
    try:
        table = DecisionTable.load(out, missing_ok=True)
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    model, _ = _load(Path(args.model), args.dtype)
    model.to(torch.device(args.device))
    start = time.perf_counter()
    with STORE.refreshing():
        try:
            lynx_hf.patch(model, cfg)
        except lynx_hf.LynxError as exc:
            raise CliError(str(exc)) from exc
    seconds = time.perf_counter() - start
    keys: dict = {}
    for block in lynx_hf.patcher._state(model).blocks:
        planned = gate_of(block.plan)
        if planned is None or planned.key is None:
            continue
        entry = keys.setdefault(planned.key.digest(), [planned, 0])
        entry[1] += 1
    if not keys:
        raise CliError(f"policy {cfg.policy!r} has no cost gate on this model (nothing remaps, or the layers' sizes "
                       "are unknown): nothing to tune")
    loaded = str(next(model.parameters()).dtype).removeprefix("torch.")
    print(f"model: {args.model}  device: {args.device}  dtype: {loaded}"
          f"{' (the checkpoint' + chr(39) + 's, as from_pretrained loads it)' if args.dtype == 'auto' else ''}  "
          f"threads: {torch.get_num_threads()}  policy: {cfg.policy}  measured in {seconds:.1f} s")
    for planned, layers in keys.values():
        table.put(planned.key, planned.decisions, planned.source)
        on = [b for b, d in sorted(planned.decisions.items()) if d.on]
        shape = planned.shape
        print(f"  {layers} layer(s) N {shape.num_experts} k {shape.top_k} H {shape.hidden} I {shape.intermediate} "
              f"{str(shape.expert_dtype or shape.dtype).removeprefix('torch.')}: "
              f"{'on at ' + ', '.join(map(str, on)) + ' tokens' if on else 'off at every step size'} ({planned.key.device}, "
              f"{planned.key.threads} threads)")
    table.save(out)
    print(f"wrote {out} ({len(table.entries)} entries); use it with --gate-table {out} or "
          f"LynxConfig(gate_table={str(out)!r}); its entries hold for the model in {loaded} at {torch.get_num_threads()} "
          f"threads on this device (a model in another dtype or at another thread count reads none of them)")
    return 0


def print_layer_table(summary: dict, layers: list) -> None:
    """Print :func:`lynx_hf.telemetry.layer_table` (per MoE layer, then the means of ``summary``)."""
    print(layer_table(summary, layers))


def _read_json(path: Path, what: str):
    """The JSON value in ``path``; :class:`CliError` if the file is missing or not JSON."""
    import json

    if not path.is_file():
        raise CliError(f"no {what} at {path}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CliError(f"{path} is not JSON: {exc}") from exc


def cmd_vllm_stats(args) -> int:
    """Print the telemetry file a vLLM worker writes (``lynx_hf.vllm``, ``stats_path``): one table per rank."""
    path = Path(args.stats_json)
    data = _read_json(path, "stats file")
    workers = data if isinstance(data, list) else [data]
    if not workers or not all(isinstance(w, dict) and "layers" in w and "summary" in w for w in workers):
        raise CliError(f"{path} is not a lynx_hf.vllm stats file (expected 'layers' and 'summary'; "
                       "for `lynx-hf generate --stats-json` files use `lynx-hf plot`)")
    for worker in workers:
        policy = (worker.get("config") or {}).get("policy", "off")
        print(f"rank {worker.get('rank', '?')}  policy: {policy}  steps: {worker.get('steps')}  decode steps: "
              f"{worker.get('decode_steps')}  mixed steps: {worker.get('mixed_steps')}")
        print_layer_table(worker["summary"], worker["layers"])
    return 0


def plot_stats(summary: dict, out: Path, title: str | None = None) -> Path:
    """Bar chart of unique experts per layer before/after from a stats summary dict; returns ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = summary.get("per_layer", [])
    if not layers:
        raise CliError("the stats JSON has no per_layer entries (was it written by `lynx-hf generate --stats-json`?)")
    names = [str(i) for i in range(len(layers))]
    before = [layer["unique_experts_before"] for layer in layers]
    after = [layer["unique_experts_after"] for layer in layers]
    fig, ax = plt.subplots(figsize=(max(4, 0.8 * len(layers) + 2), 3.2))
    xs = range(len(layers))
    ax.bar([x - 0.2 for x in xs], before, width=0.4, label="model's own routing")
    ax.bar([x + 0.2 for x in xs], after, width=0.4, label=f"policy {summary.get('policy', '?')}")
    ax.set_xticks(list(xs), names)
    ax.set_xlabel("MoE layer")
    ax.set_ylabel("unique experts / decode step")
    ax.set_title(title or f"unique experts per layer ({summary.get('decode_steps', '?')} decode steps)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def cmd_plot(args) -> int:
    summary = _read_json(Path(args.stats_json), "stats JSON")
    out = plot_stats(summary, Path(args.out), args.title)
    print(f"wrote {out}")
    return 0


#: subcommand -> (module of lynx_hf.eval, help); outputs go to --out (default: eval/results in the source
#: checkout, else ./lynx_hf_results under the working directory)
_SCRIPTS = {
    "eval": ("harness", "accuracy harness: teacher-forced decode, generation agreement, lm-eval"),
    "sweep": ("sweep", "Pareto sweep LYNX vs OEA vs XShare: --model PATH [--data ...] on your checkpoint (writes "
                       "lynx_config.json), or the fixture sweep"),
    "bench": ("bench", "MoE-layer and end-to-end decode latency benchmark (--quick: a smoke run)"),
    "report": ("router_report", "router statistics of a checkpoint"),
}


def cmd_script(args) -> int:
    """Run ``lynx_hf.eval.<module>.main(args)`` (installed with the package: no source checkout needed)."""
    import importlib

    sys.argv[0] = f"lynx-hf {args.command}"  # the script's argparse prog
    module = importlib.import_module(f"lynx_hf.eval.{_SCRIPTS[args.command][0]}")
    return int(module.main(args.args) or 0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lynx-hf", description="LYNX dynamic expert reduction for HF MoE models")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="patch a local checkpoint and generate a batch; print experts before/after",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g.add_argument("--model", default=str(DEFAULT_MODEL), help="local checkpoint folder (default: the committed fixture)")
    g.add_argument("--prompts", default=str(DEFAULT_PROMPTS), help="text file, one prompt per line")
    g.add_argument("--batch-size", type=int, default=16, help="number of prompts decoded together")
    g.add_argument("--max-new-tokens", type=int, default=32, help="greedy tokens generated per prompt")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="dtype the model is loaded in")
    g.add_argument("--stats-json", default=None, help="write the stats summary to this JSON file")
    g.add_argument("--quiet", action="store_true", help="do not print the generated texts")
    g.add_argument("--config", default=None, metavar="FILE", help="LynxConfig JSON file (LynxConfig.to_file, or the "
                   "lynx_config.json of `lynx-hf sweep --model`); the --<field> options below override its fields")
    _policy_args(g)
    g.set_defaults(func=cmd_generate)
    t = sub.add_parser("tune", help="measure the cost gate's decisions of a checkpoint on this device and write them "
                       "to a decision table (LynxConfig.gate_table)", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    t.add_argument("--model", default=str(DEFAULT_MODEL), help="local checkpoint folder (default: the committed fixture)")
    t.add_argument("--out", default="lynx_gate_table.json", help="decision table to write (merged into if it exists)")
    t.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="dtype the model is loaded in (part of the decisions' key); auto: the checkpoint's own, as "
                   "from_pretrained loads it by default")
    t.add_argument("--device", default="cpu", help="device the model runs on (cpu, cuda, cuda:1, ...)")
    t.add_argument("--config", default=None, metavar="FILE", help="LynxConfig JSON file; the --<field> options below "
                   "override its fields (the gate is always 'auto' here)")
    _policy_args(t)
    t.set_defaults(func=cmd_tune)
    p = sub.add_parser("plot", aliases=["stats"], help="turn a saved stats JSON into a PNG bar chart")
    p.add_argument("stats_json", help="file written by `lynx-hf generate --stats-json`")
    p.add_argument("--out", default="lynx_stats.png", help="PNG to write")
    p.add_argument("--title", default=None)
    p.set_defaults(func=cmd_plot)
    v = sub.add_parser("vllm-stats", help="print the telemetry file of the vLLM plugin (stats_path)")
    v.add_argument("stats_json", help="file written by a vLLM worker with lynx_hf.vllm (stats_path)")
    v.set_defaults(func=cmd_vllm_stats)
    for name, (module, text) in _SCRIPTS.items():
        s = sub.add_parser(name, help=f"{text} (python -m lynx_hf.eval.{module})", add_help=False,
                           description=f"{text}; all arguments are passed on (try `lynx-hf {name} --help`); results "
                           "go to --out (default: eval/results in the source checkout, else ./lynx_hf_results)")
        s.add_argument("args", nargs=argparse.REMAINDER)
        s.set_defaults(func=cmd_script)
    return parser


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    """The parser of subcommand ``command`` (an alias included), else ``parser``."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices.get(command, parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in _SCRIPTS:  # pass everything (``--help`` included) on to the script
        args = argparse.Namespace(command=argv[0], args=argv[1:], func=cmd_script)
    else:
        args, extra = parser.parse_known_args(argv)
        if extra:  # the subcommand's usage, not the top level's (a user typo in `generate`'s options)
            _subparser(parser, args.command).error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.func(args)
    except CliError as exc:
        print(f"lynx-hf {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as exc:  # LynxConfigError is a ValueError
        print(f"lynx-hf {args.command}: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
