"""Evaluate a model on lm-evaluation-harness benchmarks: the scores papers and model cards report.

Launch: ``tunelab run eval --config tiny/eval tasks=[arc_easy]`` (or
``tunelab run --nproc_per_node 4 eval ...``). Loads a base model or an ``epoch_{E}`` export,
optionally with a PEFT adapter on top, sharded with FSDP2 over the processes as in training;
lm-eval splits each task's documents over the ranks and rank 0 writes ``results.json`` (lm-eval's
results) to ``output_dir`` and prints the table. Tasks are registry names or task YAML files and
folders; see docs/eval.md.
"""

import json
from pathlib import Path

import tunelab.peft as peft
from tunelab import ConfigError
from tunelab.config import EvalArgs
from tunelab.data import load_tokenizer
from tunelab.distributed import destroy_distributed, init_distributed, resolve_dtype
from tunelab.eval import TunelabLM, evaluate, resolve_tasks, results_table
from tunelab.lifecycle import recipe_main
from tunelab.training import load_model

ARGS = EvalArgs


def main(args: EvalArgs) -> None:
    """Evaluate ``args.model.path`` (+ ``args.adapter_dir``) on ``args.tasks``."""
    dist_info = init_distributed(args.device)
    if args.limit is not None and args.limit < dist_info.world_size:
        raise ConfigError(
            f"limit {args.limit} is below the {dist_info.world_size} processes: every process "
            "needs at least one document of each task"
        )
    resolve_tasks(args.tasks)  # an unknown task fails before the model loads
    tokenizer = load_tokenizer(args.model.path)
    lora = None
    if args.adapter_dir is not None:
        lora = peft.LoRAArgs.from_peft_config(peft.read_adapter_config(args.adapter_dir))
    model = load_model(
        args.model.path,
        device=dist_info.device,
        dtype=resolve_dtype(args.model.dtype),
        lora=lora,
        adapter_dir=args.adapter_dir,
        seed=args.seed,
    )
    model.eval()
    lm = TunelabLM(
        model,
        tokenizer,
        batch_size=args.batch_size,
        max_length=args.max_length,
        max_gen_toks=args.max_gen_toks,
        name=args.model.path,
        seed=args.seed,
    )
    results = evaluate(
        lm,
        args.tasks,
        num_fewshot=args.num_fewshot,
        limit=args.limit,
        apply_chat_template=args.apply_chat_template,
        log_samples=args.log_samples,
        seed=args.seed,
    )
    if dist_info.is_main:
        output_dir = Path(args.output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        samples = results.pop("samples", None) or {}
        results["tunelab"] = {
            "model_path": args.model.path,
            "adapter_dir": args.adapter_dir,
        }
        with open(output_dir / "results.json", "w") as file:
            json.dump(results, file, indent=2, default=str)
        for task, rows in samples.items():
            with open(output_dir / f"samples_{task}.jsonl", "w") as file:
                for row in rows:
                    file.write(json.dumps(row, default=str) + "\n")
        print(results_table(results), flush=True)
        print(f"results: {output_dir / 'results.json'}", flush=True)
    destroy_distributed()


if __name__ == "__main__":
    recipe_main(main, ARGS)
