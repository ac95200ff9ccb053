"""RL environment engine: tasks, sandbox, tools and grading (plain Python, no Dagster)."""

from .grade import GradeConfig, GradeResult, check_task, false_positive_rate, grade, grade_cli
from .sandbox import ExecResult, Limits, Persona, Sandbox, fingerprint, realism_diff, sandbox_exec
from .tasks import TaskBuildConfig, build_tasks, check_split, check_tasks, split_tasks, task_texts
from .tools import TOOL_SCHEMAS, Episode, EpisodeConfig, Observation

__all__ = ["GradeConfig", "GradeResult", "check_task", "false_positive_rate", "grade", "grade_cli",
           "ExecResult", "Limits", "Persona", "Sandbox", "fingerprint", "realism_diff", "sandbox_exec",
           "TaskBuildConfig", "build_tasks", "check_split", "check_tasks", "split_tasks", "task_texts",
           "TOOL_SCHEMAS", "Episode", "EpisodeConfig", "Observation"]
