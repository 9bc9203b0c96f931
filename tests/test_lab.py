"""lab.py, used as a student and a teacher would: every exercise passes on the reference, a
blank copy fails the tests that grade it, the solutions in tests/lab_solutions/ pass or fail
as they say (with a message to act on), a handout grades its own d3d.py, and nothing ever
writes over d3d.py.

lab.py runs in a copy of the repository (the real runs/lab/ is never touched), its checks
two at a time, each a pytest subprocess: about seven minutes on two cores (a wrong solution's
check runs only the tests it must fail, some seven seconds, most of it importing the suite).
Run: python -m pytest -q tests/test_lab.py
"""

import ast
import concurrent.futures
import hashlib
import json
import os
import re
import subprocess
import sys
import types

import pytest
from project_files import project_files

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import lab  # noqa: E402  (the standard library only)

SOLUTIONS = os.path.join(ROOT, "tests", "lab_solutions")
BLANK_CHECKS = ("packed_attention_mask", "prune_drafter", "select_chunks")  # start, full check


def sha(path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def solution_files() -> list[str]:
    """The solutions the project ships (project_files.py): names of files in SOLUTIONS."""
    folder = os.path.relpath(SOLUTIONS, ROOT).replace(os.sep, "/")
    return sorted(
        path[len(folder) + 1 :]
        for path in project_files(".py", names=[folder])
        if path.startswith(folder + "/") and "/" not in path[len(folder) + 1 :]
    )


def solution_facts(name: str) -> dict:
    """EXERCISE, RIGHT, FAILS and (a wrong one's) RULE of a solution file, read without running
    it."""
    with open(os.path.join(SOLUTIONS, name), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    facts = {
        node.targets[0].id: ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign)
        and node.targets[0].id in ("EXERCISE", "RIGHT", "FAILS", "RULE")
    }
    return {"RULE": None, **facts}


def lab_py(cwd, *argv, timeout=1200) -> subprocess.CompletedProcess:
    """lab.py in `cwd`. The time limit is a net for a hung command, beyond lab.py check's own
    (--timeout, 900 s by default), so a check that runs long ends with lab.py's grade."""
    return subprocess.run(
        [sys.executable, "lab.py", *map(str, argv)],
        cwd=cwd,
        text=True,
        capture_output=True,
        timeout=timeout,
    )


IMPORT_ALL = """
import importlib.util, sys
for path in sys.argv[1:]:
    name = "student_%d" % len(sys.modules)
    spec = importlib.util.spec_from_file_location(name, path)
    sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sys.modules[name])
print("imported", len(sys.argv) - 1)
"""


@pytest.fixture(scope="module")
def lab_runs(tmp_path_factory):
    """A copy of the repository, the quick commands run in it (start, handout), and every
    check started two at a time: {job: Future of CompletedProcess}, plus what the tests need."""
    base = tmp_path_factory.mktemp("lab")
    repo = base / "repo"
    lab.copy_project(ROOT, str(repo))
    before = {"repo": sha(os.path.join(ROOT, "d3d.py")), "copy": sha(repo / "d3d.py")}
    starts = {e.name: lab_py(repo, "start", e.name, "--hints", level_of(e)) for e in lab.EXERCISES}
    after_start = sha(repo / "d3d.py")
    handouts = {
        "all": base / "handout-all",
        "one": base / "handout-one",
        "solved": base / "handout-solved",
    }
    made = {
        "all": lab_py(repo, "handout", handouts["all"], "--hints", "goal"),
        "one": lab_py(repo, "handout", handouts["one"], "packed_attention_mask"),
        "solved": lab_py(
            repo, "handout", handouts["solved"], "packed_attention_mask", "--hints", "steps"
        ),
    }
    reference = (repo / "d3d.py").read_text()
    right_mask = open(os.path.join(SOLUTIONS, "packed_attention_mask_by_key_kind.py")).read()
    solved = handouts["solved"] / "d3d.py"
    solved.write_text(lab.splice(solved.read_text(), right_mask))
    checks = {
        "reference": (repo, "check", "all", "d3d.py", "--quick", "--json", base / "reference.json"),
        "blank all": (
            handouts["all"],
            "check",
            "all",
            "--quick",
            "--json",
            base / "blank-all.json",
        ),
        "handout solved": (
            handouts["solved"],
            "check",
            "packed_attention_mask",
            "--json",
            base / "handout-solved.json",
        ),
    }
    for name in solution_files():
        facts = solution_facts(name)
        path = base / name
        path.write_text(lab.splice(reference, open(os.path.join(SOLUTIONS, name)).read()))
        # a right one: every test but the slow ones; a wrong one: the tests it must fail
        only = ["--quick"]
        if not facts["RIGHT"]:
            only = [a for t in facts["FAILS"] for a in ("--test", t)]
        checks[name] = (
            repo,
            "check",
            facts["EXERCISE"],
            path,
            *only,
            "--json",
            base / f"{name}.json",
        )
    for name in BLANK_CHECKS:
        checks[f"blank {name}"] = (repo, "check", name, "--json", base / f"blank-{name}.json")
    pool = concurrent.futures.ThreadPoolExecutor(2)
    futures = {key: pool.submit(lab_py, *argv) for key, argv in checks.items()}
    copies = [repo / "runs" / "lab" / e.name / "d3d.py" for e in lab.EXERCISES]
    futures["import"] = pool.submit(
        subprocess.run,
        [sys.executable, "-c", IMPORT_ALL, *copies],
        cwd=repo,
        text=True,
        capture_output=True,
        timeout=300,
    )
    yield {
        "base": base,
        "repo": repo,
        "before": before,
        "after_start": after_start,
        "starts": starts,
        "handouts": handouts,
        "made": made,
        "futures": futures,
    }
    pool.shutdown(wait=True)


def level_of(exercise) -> str:
    """The hint level each exercise is started at here: every level, in turn."""
    return lab.LEVELS[lab.EXERCISES.index(exercise) % len(lab.LEVELS)]


def finished(lab_runs, job) -> subprocess.CompletedProcess:
    return lab_runs["futures"][job].result()


def grade_json(lab_runs, name) -> dict:
    with open(lab_runs["base"] / name, encoding="utf-8") as f:
        return json.load(f)


def test_every_graded_test_is_in_the_suite_and_patches_nothing_of_d3d():
    """The selection: each exercise's tests exist in the suite's files, each name in one file only
    (the plugin selects by name), none monkeypatches d3d (those are LEFT_OUT, and each of those
    does), every claim belongs to a graded test."""
    suite = lab.suite_functions()
    defined = []
    for file in lab.SUITE:
        with open(os.path.join(ROOT, file), encoding="utf-8") as f:
            tree = ast.parse(f.read())
        defined += [n.name for n in tree.body if isinstance(n, ast.FunctionDef)]
    assert len(defined) == len(set(defined)), sorted(n for n in defined if defined.count(n) > 1)
    names = {lab.parse_test(t)[0] for e in lab.EXERCISES for t in e.right + e.fast}
    assert names <= set(suite), sorted(names - set(suite))
    assert not [n for n in names if lab.patches_d3d(suite[n])]
    assert set(lab.LEFT_OUT) <= set(suite), sorted(set(lab.LEFT_OUT) - set(suite))
    assert all(lab.patches_d3d(suite[n]) for n in lab.LEFT_OUT), lab.LEFT_OUT
    for name, (_, instead) in lab.LEFT_TO_THE_SUITE.items():  # slow, graded by another claim
        assert name in suite and not lab.patches_d3d(suite[name]), name
        for exercise, test in instead.items():
            graded = {lab.parse_test(t)[0] for t in lab.BY_NAME[exercise].right}
            graded |= {lab.parse_test(t)[0] for t in lab.BY_NAME[exercise].fast}
            assert name not in graded and lab.parse_test(test)[0] in graded, (exercise, name)
    assert set(lab.CLAIMS) == names and set(lab.SLOW) <= names
    assert all(len(f"  FAIL  {c}") <= lab.WIDTH for c in lab.CLAIMS.values())  # one line each
    assert len(lab.EXERCISES) >= 8 and all(e.right for e in lab.EXERCISES)
    assert all(e.fast or e.no_fast for e in lab.EXERCISES)
    assert set(lab.RULES) <= set(lab.BY_NAME), sorted(set(lab.RULES) - set(lab.BY_NAME))
    for name, rules in lab.RULES.items():  # each rule: a claim of its exercise, or why none
        tests = lab.BY_NAME[name].right + lab.BY_NAME[name].fast
        assert len({rule.key for rule in rules}) == len(rules), name
        assert all(bool(rule.test) != bool(rule.why_not) for rule in rules), name
        assert all(rule.test in tests for rule in rules if rule.test), name
    for exercise in lab.EXERCISES:
        assert set(exercise.hints) == set(exercise.functions)
        for test in exercise.right + exercise.fast:  # a filter names a real parameter
            name, where = lab.parse_test(test)
            arguments = {a.arg for a in suite[name].args.args}
            assert set(where) <= arguments, test


def test_the_plugin_selects_by_name_and_parameters_and_keeps_the_worst_outcome():
    item = types.SimpleNamespace(
        originalname="test_x",
        name="test_x[sync-2]",
        callspec=types.SimpleNamespace(params={"mode": "sync", "b": 2}),
    )
    assert lab._tests_of(item, ["test_x", "test_x[mode=sync]", "test_x[mode=async]", "test_y"]) == [
        "test_x",
        "test_x[mode=sync]",
    ]
    records = [
        {"kind": "selected", "nodeid": "a[1]", "tests": ["test_a"]},
        {"kind": "selected", "nodeid": "a[2]", "tests": ["test_a"]},
        {"kind": "start", "nodeid": "a[1]"},
        {"kind": "case", "nodeid": "a[1]", "outcome": "passed", "message": ""},
        {"kind": "case", "nodeid": "a[1]", "outcome": "failed", "message": "teardown"},
        {"kind": "start", "nodeid": "a[2]"},
    ]
    results = lab.gather(records, ["test_a", "test_b"], 30, 1.0)
    assert [c["outcome"] for c in results["test_a"]] == ["failed", "failed"]
    assert "within 30 s" in results["test_a"][1]["message"] and results["_missing"] == ["test_b"]
    text = (
        "Traceback (most recent call last):\n"
        '  File "/lib/_pytest/python.py", line 187, in pytest_pyfunc_call\n'
        "    result = testfunction(**testargs)\n"
        "             ^^^^^^^^^^^^^^^^^^^^^^^^\n"
        '  File "/copy/test_d3d.py", line 159, in test_m\n'
        "    assert torch.equal(a, b)\n"
        "AssertionError: assert False\n"
        " +  where False = <built-in method equal of type object at 0x7f00>(x, y)\n"
        " +    where <built-in method equal of type object at 0x7f00> = torch.equal"
    )
    assert lab.short_failure(text, "/copy") == (
        "test_d3d.py:159: assert torch.equal(a, b)\n"
        "AssertionError: assert False / + where False = "
        "equal(x, y)"
    )
    raised = (
        "Traceback (most recent call last):\n"
        '  File "/copy/test_d3d.py", line 1070, in test_async\n'
        "    out, stats = d3d.generate(target, drafter, prompt)\n"
        '  File "/copy/d3d.py", line 1900, in generate\n'
        "    stats = _decode_async(drafter, out, caches, clock, config)\n"
        '  File "/copy/d3d.py", line 1460, in _decode_async\n'
        "    *packed_inputs, segment_rows = build_branch_pass(\n"
        '  File "/copy/d3d.py", line 1167, in build_branch_pass\n'
        "    segments[:, 0] = torch.cat([candidates.flatten(), draft[:1]])\n"
        "RuntimeError: The expanded size of the tensor (3) must match"
    )
    message = lab.short_failure(raised, "/copy")
    assert message.splitlines()[0].startswith("d3d.py:1167 in build_branch_pass: segments")
    assert message.splitlines()[-1] == "d3d.py calls: generate > _decode_async > build_branch_pass"
    told = lab.explain(message, lab.BY_NAME["select_segment"])
    assert "raised in build_branch_pass, not in select_segment" in told and "calls:" not in told
    assert "which your _decode_sync calls" in lab.explain(
        message.replace("_decode_async", "_decode_sync"), lab.BY_NAME["decode_sync"]
    )
    own = lab.Exercise("x", ("build_branch_pass",), "", {}, ("t",))  # raised in the function
    assert "raised in" not in lab.explain(message, own)
    mask = lab.BY_NAME["packed_attention_mask"]
    assert "still the blank stub" in lab.explain(
        "lab exercise packed_attention_mask: write packed_attention_mask", mask
    )
    blocked = lab.explain("lab exercise draft_rows: write draft_rows", mask)
    assert "check draft_rows first" in blocked


def test_list_prints_each_level_of_an_exercises_hints():
    for level in lab.LEVELS:
        shown = lab_py(ROOT, "list", "d3d_loss", "--hints", level, timeout=60)
        assert shown.returncode == 0 and f"d3d_loss (hints: {level}):" in shown.stdout
        for hint in lab.BY_NAME["d3d_loss"].hints.values():
            assert " ".join(hint.at(level).split()) in " ".join(shown.stdout.split())


def test_list_rules_shows_each_rule_and_the_claim_that_grades_it():
    """`list NAME --rules`: every rule of RULES in its words, under it the claim (and where the
    test is) or why none grades it, then the graded tests no rule names; without NAME every
    exercise's table, one without rules showing its claims."""

    def flat(text):
        return " ".join(text.split())

    for name, rules in lab.RULES.items():
        shown = lab_py(ROOT, "list", name, "--rules", timeout=60)
        assert shown.returncode == 0 and shown.stderr == "", shown
        text = flat(shown.stdout)
        graded = [rule for rule in rules if rule.test]
        assert f"{name}: {len(graded)} rules graded, {len(rules) - len(graded)} not" in text
        for rule in rules:
            assert f"- {rule.key}: {flat(rule.says)}" in text, rule
            if rule.test:
                section = "right" if rule.test in lab.BY_NAME[name].right else "fast"
                told = f"{section}: {flat(lab.claim(lab.parse_test(rule.test)[0]))} "
                assert f"{flat(rule.says)} {told}{lab.where(rule.test)}" in text, rule
            else:
                assert f"{flat(rule.says)} not graded: {flat(rule.why_not)}" in text, rule
        exercise = lab.BY_NAME[name]
        for test in exercise.right + exercise.fast:  # every graded test shows, named or not
            assert lab.where(test) in shown.stdout, test
        for test, (what, instead) in lab.LEFT_TO_THE_SUITE.items():  # and the slow ones not run
            if name in instead:
                told = lab.slower(test, what, instead[name])
                assert f"{lab.where(test)} {flat(told)}" in text, test
    every = lab_py(ROOT, "list", "--rules", timeout=60)
    assert every.returncode == 0
    for exercise in lab.EXERCISES:
        assert f"{exercise.name}: " in every.stdout
        assert all(lab.where(t) in every.stdout for t in exercise.right + exercise.fast)


def test_list_names_every_exercise_its_place_and_its_tests():
    listed = lab_py(ROOT, "list")
    assert listed.returncode == 0
    for exercise in lab.EXERCISES:
        assert f"{exercise.name}: {exercise.paper}" in listed.stdout
        assert all(lab.where(t) in listed.stdout for t in exercise.right + exercise.fast)
    assert all(name in listed.stdout for name in lab.LEFT_OUT)
    assert all(lab.where(name) in listed.stdout for name in lab.LEFT_TO_THE_SUITE)


def test_start_blanks_one_body_and_keeps_every_other_byte(lab_runs):
    """The copy: the reference's lines but the function's body, which is the hint, the body's
    comments and the NotImplementedError; signature and docstring kept. A second start is
    refused unless --force; d3d.py is untouched."""
    repo = lab_runs["repo"]
    reference = (repo / "d3d.py").read_text().splitlines(keepends=True)
    tree = ast.parse("".join(reference))
    for exercise in lab.EXERCISES:
        level = level_of(exercise)
        assert lab_runs["starts"][exercise.name].returncode == 0
        assert f"python lab.py check {exercise.name}" in lab_runs["starts"][exercise.name].stdout
        assert f"(hints: {level})" in lab_runs["starts"][exercise.name].stdout
        folder = repo / "runs" / "lab" / exercise.name
        assert json.loads((folder / lab.START_FILE).read_text())["hints"] == level
        copy = (folder / "d3d.py").read_text()
        flat = " ".join(line.strip().lstrip("#").strip() for line in copy.splitlines())
        for function, hint in exercise.hints.items():  # its level's words, not the next one's
            assert " ".join(hint.at(level).split()) in flat.replace("Exercise: ", ""), function
            if level != "steps":
                assert " ".join(hint.steps.split()) not in flat, function
                assert f"python lab.py list {exercise.name} --hints" in copy
        nodes = sorted(
            (lab.find_function(tree, f) for f in exercise.functions), key=lambda node: node.lineno
        )
        cuts = [0] + [i for n in nodes for i in (n.body[0].end_lineno, n.end_lineno)]
        kept = [reference[a:b] for a, b in zip(cuts[::2], cuts[1::2] + [len(reference)])]
        lines, at = copy.splitlines(keepends=True), 0
        for i, part in enumerate(kept):  # the reference's lines, each body a stub between them
            assert lines[at : at + len(part)] == part, (exercise.name, i)
            at += len(part)
            if i < len(nodes):
                stub = at
                while lines[at].lstrip().startswith("#"):
                    at += 1
                assert lines[at].strip().startswith('raise NotImplementedError("lab exercise')
                at += 1
                assert "# Exercise: " in lines[stub] and all(
                    len(line.rstrip("\n")) <= 100 for line in lines[stub:at]
                )
        assert at == len(lines)
        assert all(lab.is_blank(copy, f) for f in exercise.functions)
    again = lab_py(repo, "start", "packed_attention_mask")
    assert again.returncode == 2 and again.stderr.count("\n") == 1
    assert again.stderr.startswith("error: ") and "--force" in again.stderr
    level = level_of(lab.BY_NAME["packed_attention_mask"])  # its blank check reads the level
    assert (
        lab_py(repo, "start", "packed_attention_mask", "--force", "--hints", level).returncode == 0
    )
    assert lab_runs["after_start"] == lab_runs["before"]["copy"]


def test_every_start_copy_imports(lab_runs):
    imported = finished(lab_runs, "import")
    assert imported.returncode == 0, imported.stderr[-2000:]
    assert f"imported {len(lab.EXERCISES)}" in imported.stdout


def test_every_exercise_passes_on_the_reference(lab_runs):
    """`check all` on the reference d3d.py: every exercise passes every test it ran (the slow
    ones skipped here run in test_d3d.py itself)."""
    run = finished(lab_runs, "reference")
    assert run.returncode == 0, run.stdout[-3000:]
    grades = grade_json(lab_runs, "reference.json")["exercises"]
    assert [g["exercise"] for g in grades] == [e.name for e in lab.EXERCISES]
    for g in grades:
        assert g["passed"] and all(e["cases"] >= 1 for e in g["right"] + g["fast"]), g
        assert {t.split("::")[1].split("[")[0] for t in g["not_run"]} <= set(lab.SLOW)
    assert "PASS  mask and positions follow" in run.stdout and "FAIL" not in run.stdout


@pytest.mark.parametrize("name", BLANK_CHECKS)
def test_a_blank_copy_fails_every_test_that_grades_it(lab_runs, name):
    run = finished(lab_runs, f"blank {name}")
    assert run.returncode == 1, run.stdout[-2000:]
    result = grade_json(lab_runs, f"blank-{name}.json")
    entries = result["right"] + result["fast"]
    assert result["full"] and len(entries) == len(lab.graded(lab.BY_NAME[name]))
    assert all(e["failed"] == e["cases"] >= 1 for e in entries), entries
    assert run.stdout.count("is still the blank stub: write its body") == len(entries)
    level = level_of(lab.BY_NAME[name])  # the level it was started at, and where more help is
    assert result["hints"] == level
    if level != "steps":
        more = lab.LEVELS[lab.LEVELS.index(level) + 1]
        assert f"hints: {level}; more help: python lab.py list {name} --hints {more}" in run.stdout


def test_a_handout_with_every_exercise_blank_fails_every_graded_test(lab_runs):
    made = lab_runs["made"]["all"]
    assert made.returncode == 0 and "has packed_attention_mask, d3d_loss" in made.stdout
    run = finished(lab_runs, "blank all")
    assert run.returncode == 1
    grades = grade_json(lab_runs, "blank-all.json")["exercises"]
    assert [g["exercise"] for g in grades] == [e.name for e in lab.EXERCISES]
    for g in grades:
        assert all(e["failed"] == e["cases"] >= 1 for e in g["right"] + g["fast"]), g["exercise"]


@pytest.mark.parametrize("name", solution_files())
def test_a_solution_passes_or_fails_as_it_says(lab_runs, name):
    """A right solution written otherwise passes the check; a wrong one fails the tests it
    names, each FAIL with its claim, the failing line and what went wrong."""
    facts = solution_facts(name)
    run = finished(lab_runs, name)
    result = grade_json(lab_runs, f"{name}.json")
    if facts["RIGHT"]:
        assert run.returncode == 0 and result["passed"], run.stdout[-3000:]
        return
    assert run.returncode == 1, run.stdout[-3000:]
    exercise = lab.BY_NAME[facts["EXERCISE"]]
    for entry in result["right"] + result["fast"]:
        assert not entry["passed"], entry["test"]
        message = entry["first_failure"]["message"]
        where = re.search(r"^(test_\w+\.py:\d+|d3d\.py:\d+ in (\w+)): ", message, re.M)
        assert where and "blank stub" not in message, message
        assert f"FAIL  {entry['claim']}" in run.stdout
        if where.group(2) and where.group(2) not in exercise.functions:  # raised elsewhere
            assert f"raised in {where.group(2)}" in run.stdout, run.stdout[-3000:]
    failed = {e["test"].split("::")[1].split("[")[0] for e in result["right"] + result["fast"]}
    assert failed == set(facts["FAILS"])


# The exercises without a second right solution: a different body would be the same steps
ONE_RIGHT_SOLUTION = ("decode_sync", "prune_drafter", "select_chunks")


def test_every_graded_rule_has_a_wrong_solution_that_fails_its_claim():
    """For each exercise with a rules table, one plausible wrong solution per graded rule at
    least: each names the rule it breaks (RULE), and the claim of that rule is among the tests
    it must fail (test_a_solution_passes_or_fails_as_it_says runs them)."""
    broken = {}
    for name in solution_files():
        facts = solution_facts(name)
        if facts["RIGHT"] or facts["EXERCISE"] not in lab.RULES:
            continue
        rules = {rule.key: rule for rule in lab.RULES[facts["EXERCISE"]]}
        assert facts["RULE"] in rules, f"{name}: RULE {facts['RULE']!r} is not one of {rules}"
        rule = rules[facts["RULE"]]
        assert rule.test, f"{name}: {rule.key} is graded by no test"
        assert lab.parse_test(rule.test)[0] in facts["FAILS"], (name, rule.test)
        broken.setdefault(facts["EXERCISE"], set()).add(rule.key)
    for exercise, rules in lab.RULES.items():
        graded = {rule.key for rule in rules if rule.test}
        missing = sorted(graded - broken.get(exercise, set()))
        assert not missing, f"{exercise}: no wrong solution breaks {missing}"


def test_lab_md_shows_each_passing_check_with_the_claims_a_check_grades():
    """Each exercise's "A passing check prints:" block in LAB.md shows a full check's claims,
    in the order a check prints them, and its closing counts (right R/R, fast F/F)."""
    with open(os.path.join(ROOT, "LAB.md"), encoding="utf-8") as f:
        text = f.read()
    blocks = re.findall(r"A passing check prints:\n\n```text\n(.*?)```", text, re.S)
    shown = {}
    for block in blocks:
        lines = block.splitlines()
        name = re.match(r"(\w+) passed: ", lines[-1]).group(1)
        claims = []
        for line in lines:
            if line.startswith("  PASS  "):
                claims.append(line[len("  PASS  ") :])
            elif line.startswith("        ") and claims:  # a wrapped claim goes on
                claims[-1] += " " + line.strip()
        shown[name] = ([re.sub(r" \(\d+ cases\)$", "", c) for c in claims], lines[-1])
    assert set(shown) == set(lab.BY_NAME), sorted(set(lab.BY_NAME) ^ set(shown))
    for exercise in lab.EXERCISES:
        claims, last = shown[exercise.name]
        graded = [lab.claim(lab.parse_test(t)[0]) for _, t in lab.graded(exercise)]
        assert claims == graded, exercise.name
        counts = [f"right {len(exercise.right)}/{len(exercise.right)}"]
        if exercise.fast:
            counts.append(f"fast {len(exercise.fast)}/{len(exercise.fast)}")
        assert last.startswith(f"{exercise.name} passed: {', '.join(counts)} ("), last


def test_every_exercise_has_two_wrong_solutions_and_most_a_second_right_one():
    """Each exercise: at least two plausible wrong solutions, each naming the tests it fails,
    and a right one written another way (but where the body has only one way to say it)."""
    counts = {name: [0, 0] for name in lab.BY_NAME}
    for name in solution_files():
        facts = solution_facts(name)
        assert facts["EXERCISE"] in lab.BY_NAME and (facts["RIGHT"] or facts["FAILS"]), name
        assert name.startswith(facts["EXERCISE"]), name
        counts[facts["EXERCISE"]][0] += facts["RIGHT"]
        counts[facts["EXERCISE"]][1] += not facts["RIGHT"]
    assert all(wrong >= 2 for _, wrong in counts.values()), counts
    assert all(right >= 1 for e, (right, _) in counts.items() if e not in ONE_RIGHT_SOLUTION)


def test_a_handout_grades_its_own_d3d_py_and_holds_no_answer(lab_runs):
    """In a handout `check NAME` grades the handout's own d3d.py: with a solution written
    into it, it passes. A handout holds neither the function's body nor the solutions; a
    folder that is not empty, or one inside the repository, is refused."""
    one, solved = lab_runs["handouts"]["one"], lab_runs["handouts"]["solved"]
    assert lab_runs["made"]["one"].returncode == 0
    assert json.loads((one / "lab-handout.json").read_text()) == {
        "exercises": ["packed_attention_mask"],
        "hints": lab.DEFAULT_LEVEL,
    }
    assert not (one / "tests" / "lab_solutions").exists()
    assert not (one / "tests" / "test_lab.py").exists()
    assert (one / "test_d3d.py").exists() and (one / "lab.py").exists()
    reference = (lab_runs["repo"] / "d3d.py").read_text()
    node = lab.find_function(ast.parse(reference), "packed_attention_mask")
    body = "".join(reference.splitlines(keepends=True)[node.body[0].end_lineno : node.end_lineno])
    handed = (one / "d3d.py").read_text()
    assert body not in handed and lab.is_blank(handed, "packed_attention_mask")
    assert not lab.is_blank((solved / "d3d.py").read_text(), "packed_attention_mask")
    solved_run = finished(lab_runs, "handout solved")  # no runs/lab there: its own d3d.py
    assert solved_run.returncode == 0, solved_run.stdout[-3000:]
    assert "grading d3d.py as d3d: packed_attention_mask" in solved_run.stdout
    assert grade_json(lab_runs, "handout-solved.json")["passed"]
    again = lab_py(lab_runs["repo"], "handout", one)
    assert again.returncode == 2 and "not empty" in again.stderr
    inside = lab_py(lab_runs["repo"], "handout", lab_runs["repo"] / "class")
    assert inside.returncode == 2 and "inside the repository" in inside.stderr


@pytest.mark.parametrize(
    "argv,says",
    [
        (["start", "nope"], "no exercise 'nope'"),
        (["check", "nope"], "no exercise 'nope'"),
        (["check", "select_segment"], "runs/lab/select_segment/d3d.py not found"),
        (["check", "select_segment", "missing.py"], "missing.py not found"),
        (["check", "select_segment", "README.md"], "README.md line"),
        (["check", "select_segment", "runtime.py"], "has no function select_segment"),
        (["check", "select_segment", "d3d.py", "--test", "test_zero_new_tokens"], "not graded by"),
        (["check", "select_segment", "--timeout", "0"], "--timeout"),
        (["handout", "out", "nope"], "no exercise 'nope'"),
        (["check"], "NAME"),
        (["grade", "x"], "invalid choice"),
        (["start", "select_segment", "--hints", "all"], "invalid choice"),
        (["list", "nope", "--hints", "goal"], "no exercise 'nope'"),
        (["list", "select_segment", "--hints", "more"], "invalid choice"),
        (["list", "select_segment", "--rules", "--hints", "goal"], "--rules and --hints"),
        (["list", "nope", "--rules"], "no exercise 'nope'"),
    ],
)
def test_bad_input_is_one_line_and_exit_status_2(tmp_path, argv, says):
    repo = tmp_path / "repo"
    for name in ("lab.py", "d3d.py", "runtime.py", "README.md", "test_d3d.py"):
        os.makedirs(repo, exist_ok=True)
        (repo / name).write_bytes(open(os.path.join(ROOT, name), "rb").read())
    run = lab_py(repo, *argv, timeout=60)
    assert run.returncode == 2 and run.stdout == "", run
    assert run.stderr.startswith("error: ") and run.stderr.count("\n") == 1, run.stderr
    assert says in run.stderr and " — " in run.stderr and "Traceback" not in run.stderr


def test_d3d_py_is_never_written(lab_runs):
    """Last: after every start, handout and check, d3d.py has the bytes it had."""
    for future in lab_runs["futures"].values():
        future.result()
    assert sha(os.path.join(ROOT, "d3d.py")) == lab_runs["before"]["repo"]
    assert sha(lab_runs["repo"] / "d3d.py") == lab_runs["before"]["copy"]
