"""RL environment engine: tasks, sandbox, tools and grading (plain Python, no Dagster)."""

from .checks import GradeConfig
from .grade import GradeResult, check_task, false_positive_rate, grade, grade_cli
from .realism import fingerprint, realism_diff
from .rootfs import Persona
from .sandbox import ExecResult, Limits, Sandbox, sandbox_exec
from .task_format import TaskBuildConfig, TaskLimits, task_dirs, task_texts
from .tasks import build_tasks, check_split, check_tasks, split_tasks
from .tools import TOOL_SCHEMAS, Episode, EpisodeConfig, Observation

__all__ = ["GradeConfig", "GradeResult", "check_task", "false_positive_rate", "grade", "grade_cli",
           "ExecResult", "Limits", "Persona", "Sandbox", "fingerprint", "realism_diff", "sandbox_exec",
           "TaskBuildConfig", "TaskLimits", "build_tasks", "check_split", "check_tasks", "split_tasks",
           "task_dirs", "task_texts", "TOOL_SCHEMAS", "Episode", "EpisodeConfig", "Observation"]
