"""Evaluation engine: agentic pass@k through the RL harness, HumanEval function completion,
perplexity, cost; the promotion gate; the contamination guard (plain Python, no Dagster).

    summary = evaluate(checkpoint_dir, tasks_dir, out_dir, EvalConfig(engine="vllm"))
    verdict = compare(summary, baseline_summary)         # {"passed", "reasons", "rows"}
    print(report_markdown([verdict]))
"""

from .contamination import contamination_report, task_index
from .evaluate import EvalConfig, checkpoint_digest, eval_cli, evaluate
from .gate import GateConfig, compare, decide, gain, report_markdown
from .humaneval import STOP_SEQUENCES, check_completion, score_completions, truncate
from .metrics import aggregate, pass_at_k, stderr

__all__ = ["contamination_report", "task_index", "EvalConfig", "checkpoint_digest", "eval_cli", "evaluate",
           "GateConfig", "compare", "decide", "gain", "report_markdown", "STOP_SEQUENCES", "check_completion", "score_completions", "truncate",
           "aggregate", "pass_at_k", "stderr"]
