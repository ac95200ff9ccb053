"""What a bootstrap is asked (``BootstrapConfig``) and the one reason a failed one gives
(``REASONS``, ``BootstrapError``): every step, from the fetch to the suite's runs, reads the first
and raises the second, so both sit below them all."""

from __future__ import annotations

from typing import Optional

from pydantic import Field

from composer_dag.runtime.config import StageConfig

REASONS = ("fetch_failed", "unsupported_layout", "licence_excluded", "install_failed", "needs_network",
           "suite_does_not_start", "no_tests_found", "tests_fail_at_base", "timeout")
SHIFTED_TIME = "2031-03-14 09:26:53"
# what a build or a suite prints when it reached for the network (the sandbox has none)
NETWORK_ERRORS = (r"Network is unreachable|Temporary failure in name resolution|Name or service not known|"
                  r"No address associated with hostname|Connection refused|ConnectionError|gaierror")


class BootstrapError(Exception):
    def __init__(self, reason: str, message: str):
        assert reason in REASONS, reason
        super().__init__(message)
        self.reason = reason


class BootstrapConfig(StageConfig):
    """How a repository is made into an environment."""

    test_timeout: float = Field(600.0, description="seconds for one run of the suite in the sandbox")
    install_timeout: float = Field(600.0, description="seconds for the wheel build and the layer install")
    shifted_time: str = Field(SHIFTED_TIME, description="the wall clock of the third run (faketime)")
    hash_seeds: tuple[int, int] = Field((0, 4242), description="PYTHONHASHSEED of the plain runs and of the shifted run")
    random_seeds: tuple[int, int] = Field((0, 97), description="random.seed of the plain runs and of the shifted run")
    exclude_licences: tuple[str, ...] = Field((), description="licences (as recorded, case-insensitive) refused")
    store: Optional[str] = Field(None, description="the wheel store and layers (default: $COMPOSER_HOME/wheel-store)")
    max_test_files: int = Field(400, description="test files run at most (the first, by path)")
    test_files: Optional[tuple[str, ...]] = Field(None, description="only the test files matching these globs "
                                                                    "(relative to the project root); None: every one")
