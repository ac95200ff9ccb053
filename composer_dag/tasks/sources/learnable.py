"""The learnable task family: put one word, named in the instructions, into ``answer.txt``.

A tiny model can learn it on CPU within minutes, in the real task format with the ordinary
grader (hidden tests in a sandbox, cheat flags). The user's request is also in the repository
(``request.txt``, the word quoted), as a ticket would be, so there are two ways to solve a task:
copy the word from the instructions into an ``edit_file`` call, or move it with the shell
(``SOLUTION_COMMAND``, the reference procedure SFT demonstrates), which works for any word. Each word is a task's ``source_file``
(``learnable:<word>``), so the split by source file puts every word on one side: held-out tasks
ask for words never seen in training, and pass@1 on them measures the behaviour, not memory.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from composer_dag.tasks.format import TaskLimits
from composer_dag.tasks.registry import BuildRequest, task_source
from composer_dag.tasks.sources.write import write_checked_task

SOURCE = "learnable"

ANSWER_FILE = "answer.txt"
REQUEST_FILE = "request.txt"
SOLUTION_COMMAND = f"cut -d'\"' -f2 {REQUEST_FILE} > {ANSWER_FILE}"
"""The reference procedure: the word is the only quoted text of the request."""
PROJECT = "notes"
WORD_POOL = tuple("""
    that value method self name module used string other this will objects defined which when only
    same code should also values types methods clause version built must called pattern have using
    suite block number default first example names then they raised such call given case items
    keyword section result classes context keys does than there current more base mapping line
    syntax target special returns empty created support length item within local point numbers order
    left raises most form each strings bound where their either found right before always integer
    index subject true mutable single like define after those present manager frame passed command
    access scope defines these occurs last match instead through numeric into equal body level uses
    part zero three binding program cannot both some being been start lists details loop step normal
    literal data copy time over means matches width calls future invoked digits unless below false
    nested create whose itself without decimal error stack user rather provide yields runtime rules
    count between slicing allows were handler handled contain field option once valid compare group
    source another would clauses refer added detail even treated lookup owner space file about least
    primary stored search modules sets sign operand display simple comma follows during binary
    allowed them removed because formal until execute less similar done control common custom
    calling stop omitted change side pair place meaning made above fails pairs test read feature
    allow still setting whether note cases lines around clear prefix view targets back never leading
    text certain listed caught guard append split digit table under include occur already library
    total changes bitwise truth follow reverse hand effect tuples needs saved slot results since
    exist free latter cause exactly inside named just well modulo recent need entire garbage double
    remove trace usually static event derived bases power second useful nearest specify becomes
    tests binds iterate succeed terms star builds indices unary insert square refers lower points
    proper accept
""".split())
"""Words for the default task set, one task each: frequent words of the Python reference manual
(fixed here, so every machine builds the same tasks). Many distinct words make copying the word,
not remembering a few, what lowers the loss."""
LIMITS = TaskLimits(max_turns=3, command_timeout=10.0, test_timeout=30.0)


def instructions(word: str) -> str:
    return f"Write the word {word} into a new file {ANSWER_FILE}, then submit."


def request(word: str) -> str:
    """The ticket in the repository: the word quoted, the only quoted text."""
    return f'Please write the word "{word}" into a new file {ANSWER_FILE}, then submit.\n'


def build_learnable_tasks(out_dir, n: int, seed: int = 0, words=WORD_POOL, limits: TaskLimits = LIMITS,
                          canaries: bool = True, workers: int = 1, request_file: bool = True) -> list[Path]:
    """Write ``n`` task directories (``task.json``, ``repo/``, ``hidden_tests/``,
    ``reference/``) under ``out_dir``: every word once (seeded order) before any word twice."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    # distinct words while there are enough; beyond that the words repeat, in a seeded order
    order = list(words) if n <= len(words) else list(words) * (n // len(words) + 1)
    rng.shuffle(order)

    def one(i: int, word: str) -> Path:
        tid = f"answer-{seed}-{i:03d}"
        task = {"id": tid, "source": SOURCE, "source_file": f"learnable:{word}", "project": PROJECT,
                "instructions": instructions(word), "limits": limits.to_dict(),
                "reference": {"files": [ANSWER_FILE], "kind": "answer", "word": word,
                              **({"command": SOLUTION_COMMAND} if request_file else {})},
                "sandbox": {"masks": {}}}
        readme = "# notes\n\nScratch space for short answers.\n"
        hidden = ("from pathlib import Path\n\n\ndef test_answer():\n"
                  f"    p = Path({ANSWER_FILE!r})\n"
                  f"    assert p.is_file() and p.read_text().strip() == {word!r}\n")
        history = [("Initial commit", {"README.md": readme})]
        if request_file:
            history.append(("Add the request", {REQUEST_FILE: request(word)}))
        return write_checked_task(out / tid, task, history,
                                  {"test_answer.py": hidden}, {ANSWER_FILE: word + "\n"}, canaries=canaries)

    with ThreadPoolExecutor(max(1, workers)) as pool:
        return list(pool.map(one, range(n), order[:n]))


@task_source(name=SOURCE, count=100, count_field="learnable_count", rl=True, eval_every_task=True, gain=True)
def build(req: BuildRequest) -> list[Path]:
    """``count`` tasks: the first ``count`` words of ``WORD_POOL`` (all of them, repeated, beyond)."""
    words = WORD_POOL[:req.count] if req.count <= len(WORD_POOL) else WORD_POOL
    return build_learnable_tasks(req.out, req.count, req.config.seed, words, workers=req.config.workers) \
        if req.count else []
