"""The ``csx`` command line.

    csx run --params P.yaml [--num_csx N] [--cpus_per_csx C] [--gpus_per_csx G]
            [--mode train|eval|train_and_eval|eval_all]
            [--model_dir D] [--checkpoint_path C] [--validate_only] [--set KEY.PATH=VALUE ...]
            [--unset KEY.PATH ...] [--logging DEBUG]
    csx convert FILE --to trainer|params [-o OUT]
    csx preprocess --input TEXT [TEXT ...] --output_dir D --max_sequence_length N
            [--vocab_file F [--merges_file M]]
    csx finalize --input ckpt --output ckpt [--mode zeros|nan] [--csr out.npz]

The job service's subcommands (``SERVICE_COMMANDS``: serve, submit, study, token, local-study)
are service/cli.py's: it is imported only when one of them is used, so ``csx run`` never loads
the web stack. This package sits above both ``training``/``workers`` and ``service``; neither
imports it.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any, Callable, TextIO

import yaml
from pydantic import ValidationError

from csx_config import JobSpec, format_problems, parse_yaml
from tracking.server import MLFLOW_AWAY, MLFLOW_BACK
from training.plan import MODES

MLFLOW_MESSAGES = {
    MLFLOW_AWAY: "the MLflow server does not answer ({reason}): training goes on, its metrics "
                 "and masks wait in the model_dir's mlflow_spool/ until it does",
    MLFLOW_BACK: "the MLflow server answers again: what the run kept is sent",
}

SERVICE_COMMANDS = ("serve", "submit", "study", "token", "local-study")


class ProgressPrinter:
    """step/max, loss, tokens/s and ETA: one line redrawn in place on a terminal, a plain line
    per logged step otherwise (logs, CI)."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()

    def __call__(self, event: dict[str, Any]) -> None:
        if event.get("event") in MLFLOW_MESSAGES:  # from the run's tracker (tracking/server.py)
            line = "[csx] " + MLFLOW_MESSAGES[event["event"]].format(**event)
            print(("\n" if self.tty else "") + line, file=self.stream, flush=True)  # off the bar
            return
        if "step" not in event:  # runner events (e.g. "recovering") are printed as they are
            print(f"[csx] {event}", file=self.stream)
            return
        done = event["step"] / event["max_steps"]
        bar = "#" * int(20 * done)
        line = (f"step {event['step']}/{event['max_steps']} [{bar:<20}] loss {event['loss']:.4f} "
                f"{event['tokens_per_s']:,.0f} tok/s ETA {time.strftime('%H:%M:%S', time.gmtime(event['eta_s']))}")
        if self.tty:
            end = "\n" if event["step"] == event["max_steps"] else ""
            print(f"\r{line}", end=end, file=self.stream, flush=True)
        else:
            print(line, file=self.stream, flush=True)


def _add_run(subparsers: Any) -> None:
    parser = subparsers.add_parser("run", help="train / evaluate a params YAML")
    parser.add_argument("--params", required=True, help="ModelZoo-style params YAML")
    parser.add_argument("--num_csx", type=int, default=None,
                        help="simulated CS-2 systems (default: runconfig.num_csx)")
    parser.add_argument("--cpus_per_csx", type=int, default=None,
                        help="CPUs (torch threads) per system (default: runconfig.cpus_per_csx, "
                             "else the free CPUs shared by the job's systems)")
    parser.add_argument("--gpus_per_csx", type=int, default=None,
                        help="GPUs per system, 0 for CPU only (default: runconfig.gpus_per_csx, "
                             "else 1 where the cluster has a GPU per system)")
    parser.add_argument("--mode", choices=MODES, default="train")
    parser.add_argument("--model_dir", default=None,
                        help="checkpoints and tokenizer (default: runconfig.model_dir or ./runs/<params name>)")
    parser.add_argument("--checkpoint_path", default=None, help="start from / evaluate this checkpoint")
    parser.add_argument("--validate_only", action="store_true",
                        help="print the plan (matched parameters, sparsity, FLOPs, projected step time) and exit")
    parser.add_argument("--set", dest="overrides", action="extend", nargs="+", default=[],
                        metavar="KEY.PATH=VALUE",
                        help="override params keys, typed by the schema, e.g. "
                             "--set model.num_hidden_layers=2 model.hidden_size=256 (any layout's file)")
    parser.add_argument("--unset", dest="overrides", action="extend", nargs="+", type=lambda key: f"~{key}",
                        metavar="KEY.PATH", help="remove keys from the params, e.g. --unset model.foo "
                                                 "(the same as --set '~model.foo')")
    parser.add_argument("--python_paths", nargs="+", default=[], metavar="DIR",
                        help="folders of your own code (e.g. a SparsityAlgorithm subclass the params "
                             "name as `algorithm: MyAlgo`), imported before the run; CLI only")
    parser.add_argument("--logging", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    parser.set_defaults(handler=_run)


def _add_finalize(subparsers: Any) -> None:
    parser = subparsers.add_parser("finalize", help="fold masks into a checkpoint's weights")
    parser.add_argument("--input", required=True, help="training checkpoint")
    parser.add_argument("--output", required=True, help="finalized checkpoint to write")
    parser.add_argument("--mode", choices=["zeros", "nan"], default="zeros",
                        help="value at pruned positions: 0, or NaN (cstorch's sparse form)")
    parser.add_argument("--csr", default=None, help="also export the sparse weights as CSR to this .npz")
    parser.set_defaults(handler=_finalize)


def _add_preprocess(subparsers: Any) -> None:
    parser = subparsers.add_parser("preprocess", help="text files -> ModelZoo HDF5 (input_ids, attention_mask, labels)")
    parser.add_argument("--input", nargs="+", required=True,
                        help="text files, folders of .txt files, or builtin:shakespeare")
    parser.add_argument("--output_dir", required=True, help="folder for data-*.h5 and data_params.json")
    parser.add_argument("--max_sequence_length", type=int, required=True)
    parser.add_argument("--vocab_file", default=None,
                        help="BPE from a local file: a tokenizers JSON, or a GPT-2 vocab.json with --merges_file "
                             "(default: UTF-8 bytes, vocab 256)")
    parser.add_argument("--merges_file", default=None)
    parser.add_argument("--samples_per_file", type=int, default=2000)
    parser.set_defaults(handler=_preprocess)


def _add_convert(subparsers: Any) -> None:
    parser = subparsers.add_parser("convert", help="write a ModelZoo file (any layout) normalised, "
                                                   "in the params or the trainer layout")
    parser.add_argument("file", help="ModelZoo YAML: 1.x params, 2.x params or trainer layout")
    parser.add_argument("--to", choices=["params", "trainer"], required=True)
    parser.add_argument("-o", "--output", default=None, help="file to write (default: stdout)")
    parser.set_defaults(handler=_convert)


TRAINING_COMMANDS: dict[str, Callable[[Any], None]] = {"run": _add_run, "finalize": _add_finalize,
                                                       "preprocess": _add_preprocess, "convert": _add_convert}


def _load_spec(args: argparse.Namespace) -> JobSpec:
    path = Path(args.params)
    if not path.is_file():
        raise ValueError(f"--params {args.params!r} is not a file")
    flags = [f"runconfig.{key}={value}" for key, value in
             (("num_csx", args.num_csx), ("checkpoint_path", args.checkpoint_path),
              ("cpus_per_csx", args.cpus_per_csx), ("gpus_per_csx", args.gpus_per_csx))
             if value is not None]
    return JobSpec.from_yaml(path.read_text(encoding="utf-8"), [*args.overrides, *flags])


def _run(args: argparse.Namespace) -> int:
    if args.python_paths:  # before the spec is planned: its sparsity may name a class in them
        from sparsity.plugins import import_python_paths

        import_python_paths(args.python_paths)
    spec = _load_spec(args)
    from training.plan import plan_job
    from training.report import plan_report, plan_table

    plan = plan_job(spec)  # the job as it runs: the runner, its workers and the loop read this
    if args.validate_only:
        for note in plan.upgrades:
            print(f"upgraded: {note}")

        print(plan_table(plan_report(plan), debug=args.logging == "DEBUG"))
        return 0
    from training.data import check_data
    from training.memory import too_big
    from training.report import available_memory

    # Arithmetic first: a model far too big is refused before anything is built.
    refusal = too_big(spec, plan.num_csx, available_memory() // plan.num_csx)
    if refusal:
        raise ValueError(f"model: {refusal}")
    plan_report(plan)  # its layers and sparsity groups, on the meta device
    check_data(plan.data)  # before any worker starts
    for note in plan.upgrades:
        logging.getLogger("csx").info("upgraded: %s", note)
    for key, why in plan.not_applied.items():
        logging.getLogger("csx").info("not applied here: %s (%s)", key, why)
    model_dir = args.model_dir or spec.runconfig.model_dir or str(Path("runs") / Path(args.params).stem)
    progress = ProgressPrinter()
    from tracking.tracker import cli_run_name, sparsity_params

    # Named and tagged alike on 1 and N systems: runs of different files stay apart.
    run_name = cli_run_name(args.params, str(sparsity_params(spec.sparsity)["algorithm"]))
    tags = {"csx.params_file": Path(args.params).name}
    from workers.runner import run_job

    summary = run_job(plan, mode=args.mode, model_dir=model_dir, progress=progress, run_name=run_name,
                      tags=tags, tracking=bool(plan.experiment))
    for warning in summary.get("warnings", []):  # logged where the loop ran, a Ray worker
        logging.getLogger("csx").warning("%s", warning)
    shown = {k: v for k, v in summary.items()
             if k not in ("train_losses", "mask_hashes", "eval_history", "warnings")}
    print(json.dumps(shown, indent=2, default=str))
    return 0


def _convert(args: argparse.Namespace) -> int:
    path = Path(args.file)
    if not path.is_file():
        raise ValueError(f"{args.file!r} is not a file")
    spec = JobSpec.model_validate(parse_yaml(path.read_text(encoding="utf-8")))
    data, dropped = spec.to_layout(args.to)
    for note in spec.upgrades():
        print(f"csx convert: upgraded {note}", file=sys.stderr)
    if dropped:
        print(f"csx convert: left out (not applied here, no {args.to} key): {', '.join(dropped)}",
              file=sys.stderr)
    text = yaml.safe_dump(data, sort_keys=False)
    if args.output:
        Path(args.output).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return 0


def _preprocess(args: argparse.Namespace) -> int:
    from training.preprocess import preprocess

    summary = preprocess(args.input, args.output_dir, max_sequence_length=args.max_sequence_length,
                         vocab_file=args.vocab_file, merges_file=args.merges_file,
                         samples_per_file=args.samples_per_file)
    print(json.dumps(summary, indent=2))
    return 0


def _finalize(args: argparse.Namespace) -> int:
    from training.checkpoint import finalize_checkpoint

    summary = finalize_checkpoint(args.input, args.output, mode=args.mode, csr_path=args.csr)
    print(json.dumps(summary, indent=2))
    return 0


def build_parser(command: str | None) -> argparse.ArgumentParser:
    """Every training subcommand, and the service's: its module is imported only when
    ``command`` names one of them, else they are listed with a one-line placeholder help."""
    parser = argparse.ArgumentParser(prog="csx", description="weight-sparse training on simulated CS-2 systems")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for add in TRAINING_COMMANDS.values():
        add(subparsers)
    if command in SERVICE_COMMANDS:
        from service import cli as service_cli

        service_cli.register(subparsers)
    else:
        for name in SERVICE_COMMANDS:
            subparsers.add_parser(name, help="(the job service)", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(command).parse_args(argv)
    level = getattr(args, "logging", "INFO")
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    if level != "DEBUG":  # HTTP clients log every request at INFO, drowning the progress lines
        for chatty in ("httpx", "httpcore"):
            logging.getLogger(chatty).setLevel(logging.WARNING)
    try:
        return args.handler(args)
    except ValueError as err:  # bad spec or input: the message names the field, no traceback
        message = format_problems(err) if isinstance(err, ValidationError) else err
        print(f"csx {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
