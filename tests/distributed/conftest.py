"""The distributed test modules name their cases in ``CASES`` (``launcher.Case``); the
``case_results`` fixture runs the ones this session selected once per module, grouped
(``launcher.run_cases``), and each test asserts its own case's outcome
(``launcher.assert_passed``)."""

import pytest

from tests.distributed.launcher import run_cases, selected_cases


@pytest.fixture(scope="module")
def case_results(request, tmp_path_factory) -> dict[str, str | None]:
    cases = selected_cases(request, request.module.CASES)
    return run_cases(cases, str(tmp_path_factory.mktemp("rank_reports")))
