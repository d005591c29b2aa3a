"""Mutants of what the suite-time work added: the order xdist's workers are handed test files
(tests/conftest.py, heaviest first: tests/suite/test_xdist_order.py) and the encoded corpus kept
for the next build in a process (torchllm/data/token_stream.py: tests/unit/data/
test_encoded_kept.py). scripts/mutation_check.py runs them."""

from __future__ import annotations

from mutants.base import Mutant

ORDER = "tests/suite/test_xdist_order.py"
KEPT = "tests/unit/data/test_encoded_kept.py"

MUTANTS = [
    Mutant.at(
        "heavy_files_last", "the workers' files are sorted lightest first (a heavy file of one "
        "slow test starts last and runs alone at the end)",
        "tests.conftest:heavy_files_first",
        "key=lambda item: (-weight[", "key=lambda item: (weight[",
        (f"{ORDER}::test_heavy_files_start_first_each_file_whole_and_in_its_order",
         f"{ORDER}::test_only_xdist_workers_reorder_their_items"),
    ),
    Mutant.at(
        "xdist_resorts_files_by_test_count", "the controller keeps xdist's re-sorting of files "
        "by their number of tests, which undoes the workers' heavy-first order",
        "tests.conftest:pytest_configure",
        "config.option.loadscopereorder = False", "config.option.loadscopereorder = True",
        (f"{ORDER}::test_xdist_keeps_the_workers_order_on_the_controller_only",),
    ),
    Mutant.at(
        "slow_tests_weigh_as_quick_ones", "a slow test weighs as a quick one: files are "
        "ordered by their number of tests again",
        "tests.conftest:heavy_files_first",
        "SLOW_S if item.get_closest_marker(\"slow\") else QUICK_S", "QUICK_S",
        (f"{ORDER}::test_heavy_files_start_first_each_file_whole_and_in_its_order",),
    ),
    Mutant.at(
        "encoded_kept_by_tokenizer_class_only", "the kept encoding is found by the tokenizer's "
        "class and the text, not its file: a new tokenizer file at the same path gets the old "
        "file's tokens",
        "torchllm.data.token_stream:encoded_documents",
        "(type(base).__name__, digest, texts_identity(texts))",
        "(type(base).__name__, texts_identity(texts))",
        (f"{KEPT}::test_another_file_or_new_content_at_the_same_path_is_encoded_anew",),
    ),
    Mutant.at(
        "encoded_kept_handed_out_itself", "the kept arrays themselves are handed out: a run that "
        "writes into its tokens changes the next run's",
        "torchllm.data.token_stream:encoded_documents",
        "return tuple(a.copy() for a in _encoded[key])", "return _encoded[key]",
        (f"{KEPT}::test_the_same_text_and_file_is_encoded_once_and_equals_the_encoding_by_hand",),
    ),
    Mutant.at(
        "encoded_kept_never_found", "the kept encoding is never used: every build encodes the "
        "corpus again",
        "torchllm.data.token_stream:encoded_documents",
        "    if key in _encoded:\n", "    if key in _encoded and False:\n",
        (f"{KEPT}::test_the_same_text_and_file_is_encoded_once_and_equals_the_encoding_by_hand",),
    ),
]
