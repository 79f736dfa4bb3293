"""lm-eval against our server and against transformers on the same weights (issue 16 item 5; a script, not a test).

Two small tasks whose data is generated here (no hub download), written as
lm-eval task YAMLs in a temporary folder:
- `disagg_arith_mc` (multiple choice: loglikelihood requests, which lm-eval's
  `local-completions` sends as `echo: true, logprobs: 1, max_tokens: 1`),
- `disagg_arith_gen` (generate_until, greedy, exact match).
Runs, each a separate `lm-eval run`:
- `hf` (transformers, fp32, CPU) on both tasks, and with `--apply_chat_template` on the generation task;
- `local-completions` on both tasks, against a mixed worker and a PD pair;
- `local-chat-completions` on the generation task, against the same two.
Prints the scores side by side, the largest difference of a per-choice
loglikelihood between transformers and each server, and how many generated
answers are transformers' own, text for text.

    pip install lm-eval   # into any environment that can import disagg (its own venv works too)
    .venv/bin/python benchmarks/eval_lm.py [--model builtin:smollm2-135m] [--items 40] [--lm-eval lm-eval]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from disagg.workers.demo import running_pair
from disagg.workers.engine.loader import default_cache_dir, resolve_model_dir
from disagg.workers.local import WorkerProcess, spawn_worker

SERVED = "smollm2"
MC, GEN = "disagg_arith_mc", "disagg_arith_gen"
EXAMPLES = "Question: What is 2 plus 3?\nAnswer: 5\nQuestion: What is 10 plus 4?\nAnswer: 14\n"  # the format, shown


def write_tasks(folder: Path, items: int, seed: int = 0) -> None:
    """Arithmetic questions with four numeric choices, as a JSON-lines dataset and two task YAMLs."""
    rng = random.Random(seed)
    rows = []
    for _ in range(items):
        a, b = rng.randint(2, 49), rng.randint(2, 49)
        choices = [a + b, a + b + 1, a + b - 1, a + b + 10]
        rng.shuffle(choices)
        rows.append({"question": f"{EXAMPLES}Question: What is {a} plus {b}?\nAnswer:",
                     "choices": [f" {c}" for c in choices], "answer": choices.index(a + b)})
    data = folder / "arith.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
              "doc_to_text: \"{{question}}\"\n")
    (folder / f"{MC}.yaml").write_text(
        f"task: {MC}\n{common}output_type: multiple_choice\ndoc_to_choice: \"{{{{choices}}}}\"\n"
        "doc_to_target: answer\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n")
    (folder / f"{GEN}.yaml").write_text(
        f"task: {GEN}\n{common}output_type: generate_until\ndoc_to_target: \"{{{{choices[answer]}}}}\"\n"
        "generation_kwargs:\n  until: [\"\\n\", \".\"]\n  max_gen_toks: 8\n  do_sample: false\n  temperature: 0\n"
        "metric_list:\n  - metric: exact_match\n    regexes_to_ignore: [\" \"]\n")


def run_lm_eval(lm_eval: str, tasks: Path, out: Path, model: str, model_args: str, task: str,
                chat: bool = False) -> dict[str, Any]:
    """One `lm-eval run`; its results and per-sample records."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [lm_eval, "run", "--model", model, "--model_args", model_args, "--tasks", task, "--include_path",
           str(tasks), "--output_path", str(out), "--log_samples", "--batch_size", "8", "--device", "cpu", "--verbosity", "WARNING"]
    if chat:
        cmd.append("--apply_chat_template")
    subprocess.run(cmd, check=True, timeout=1800)
    results = json.loads(next(out.rglob("results_*.json")).read_text())
    samples = [json.loads(line) for line in next(out.rglob(f"samples_{task}_*.jsonl")).read_text().splitlines()]
    return {"scores": results["results"][task], "samples": samples}


def _loglikelihoods(run: dict[str, Any]) -> dict[tuple[int, int], float]:
    """(doc, choice) -> loglikelihood, from a multiple-choice run's samples."""
    return {(s["doc_id"], i): float(r[0][0]) for s in run["samples"] for i, r in enumerate(s["resps"])}


def _same_generations(run: dict[str, Any], reference: dict[str, Any]) -> str:
    """How many generated answers are the reference's, text for text."""
    ref = {s["doc_id"]: s["resps"] for s in reference["samples"]}
    return f"{sum(s['resps'] == ref[s['doc_id']] for s in run['samples'])}/{len(ref)}"


def _score(run: dict[str, Any], metric: str) -> str:
    value = next((v for k, v in run["scores"].items() if k.startswith(metric + ",")), None)
    return "-" if value is None else f"{value:.4f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="builtin:smollm2-135m")
    ap.add_argument("--items", type=int, default=40)
    ap.add_argument("--lm-eval", default=shutil.which("lm-eval") or "lm-eval", help="the lm-eval command")
    args = ap.parse_args()
    model_dir = resolve_model_dir(args.model, default_cache_dir())
    work = Path(tempfile.mkdtemp(prefix="disagg-lm-eval-"))
    tasks = work / "tasks"
    tasks.mkdir()
    write_tasks(tasks, args.items)
    hf = f"pretrained={model_dir},dtype=float32"
    runs: dict[str, dict[str, Any]] = {
        "hf": run_lm_eval(args.lm_eval, tasks, work / "hf-mc", "hf", hf, MC),
        "hf gen": run_lm_eval(args.lm_eval, tasks, work / "hf-gen", "hf", hf, GEN),
        "hf chat": run_lm_eval(args.lm_eval, tasks, work / "hf-chat", "hf", hf, GEN, chat=True),
    }
    engine = ["--device", "cpu", "--dtype", "float32", "--served-model-name", SERVED, "--max-model-len", "1024"]

    def against(name: str, server: WorkerProcess) -> None:
        url = server.base_url + "/v1"
        api = f"model={SERVED},tokenizer_backend=huggingface,tokenizer={model_dir},num_concurrent=4,max_retries=1"
        runs[name] = run_lm_eval(args.lm_eval, tasks, work / f"{name}-mc", "local-completions",
                                 f"{api},base_url={url}/completions", MC)
        runs[f"{name} gen"] = run_lm_eval(args.lm_eval, tasks, work / f"{name}-gen", "local-completions",
                                          f"{api},base_url={url}/completions", GEN)
        runs[f"{name} chat"] = run_lm_eval(args.lm_eval, tasks, work / f"{name}-chat", "local-chat-completions",
                                           f"{api},base_url={url}/chat/completions", GEN, chat=True)

    mixed = spawn_worker("mixed", str(model_dir), work / "mixed.log", engine)
    try:
        mixed.wait_loaded(600)
        against("mixed", mixed)
    finally:
        mixed.stop()
    with running_pair(str(model_dir), work, engine, 600) as (prefill, _decode):
        against("pd", prefill)

    reference = _loglikelihoods(runs["hf"])
    print(f"\n{args.items} items; lm-eval {args.lm_eval}; work folder {work}\n")
    print("| model | acc | acc_norm | max abs loglikelihood diff vs hf | exact_match (completions) | "
          "same answers as hf | exact_match (chat) | same answers as hf |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name in ("hf", "mixed", "pd"):
        ll = _loglikelihoods(runs[name])
        diff = max(abs(ll[k] - reference[k]) for k in reference)
        print(f"| {'transformers (hf)' if name == 'hf' else name} | {_score(runs[name], 'acc')} | "
              f"{_score(runs[name], 'acc_norm')} | {diff:.2e} | {_score(runs[name + ' gen'], 'exact_match')} | "
              f"{_same_generations(runs[name + ' gen'], runs['hf gen'])} | "
              f"{_score(runs[name + ' chat'], 'exact_match')} | {_same_generations(runs[name + ' chat'], runs['hf chat'])} |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
