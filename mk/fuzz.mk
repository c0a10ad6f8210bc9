# Property-based tests with a larger budget (tests/conftest.py's "fuzz" profile: 5000 generated cases per
# property instead of make test's 200); the same files `make test` runs.
FUZZ_TESTS ?= tests/pipeline/test_property_readers.py tests/ops/test_ops_property_readers.py \
  tests/pipeline/test_regenerate.py::test_any_server_reply_is_an_answer_or_a_named_rejection_never_a_traceback \
  tests/pipeline/test_regenerate.py::test_any_input_file_of_regenerate_and_evaluate_is_read_or_refused_in_one_line
.PHONY: fuzz
fuzz: env ## property tests of every reader and option, 5000 generated cases each (HYPOTHESIS_PROFILE=fuzz)
	HYPOTHESIS_PROFILE=fuzz $(PY) -m pytest $(FUZZ_TESTS) $(PYTEST_ARGS)
