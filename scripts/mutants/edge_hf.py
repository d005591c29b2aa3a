"""Mutants of a Hugging Face folder read through one Store and of hf's one-line refusals
(issue 61, items 3 and 15; scripts/mutation_check.py runs them)."""

from __future__ import annotations

from mutants.base import Mutant

T = "tests/test_edge_hf.py::"

MUTANTS = [
    Mutant.at(
        "hf_index_shard_leads_out", "hf import reads a shard the index names ../x or /abs/x",
        "torchllm.hf_folder:shard_names", "            plain_parts(shard)\n",
        "            pass\n",
        (T + "test_an_index_naming_a_shard_outside_the_folder_is_refused",
         T + "test_initial_load_in_hf_refuses_a_shard_outside_the_folder"),
    ),
    Mutant.at(
        "hf_shard_read_by_path", "hf import reads a shard by its path, following a link",
        "torchllm.hf_folder:load_shard",
        "    with store.open(name) as f:", '    with open(store.where(name), "rb") as f:',
        (T + "test_a_linked_shard_or_config_is_refused_not_followed",),
    ),
    Mutant.at(
        "hf_nested_json_traceback", "a deeply nested config.json / index is a RecursionError "
        "traceback", "torchllm.hf_folder:parse_json", "    except RecursionError:\n",
        "    except ZeroDivisionError:\n",
        (T + "test_a_deeply_nested_json_file_is_named",),
    ),
    Mutant.at(
        "hf_json_unbounded", "an HF folder's JSON files are read whatever their size",
        "torchllm.hf_folder:read_json", "read_bytes(store, name, JSON_MAX)",
        "read_bytes(store, name, None)",
        (T + "test_an_oversized_index_is_refused_before_it_is_read",),
    ),
    Mutant.at(
        "hf_tokenizer_config_unchecked", "hf import copies a garbage tokenizer_config.json "
        "into the seed (json's error names no file)", "torchllm.hf_folder:tokenizer_bytes",
        "        parse_json(data, store.where(name))\n", "",
        (T + "test_a_garbage_tokenizer_config_is_named",),
    ),
    Mutant.at(
        "hf_added_tokens_decoder_traceback", "a tokenizer_config.json whose added_tokens_decoder "
        "is no object is an AttributeError traceback",
        "torchllm.checkpoint.stage.tokenizer_identity:_hf_folder_tokenizer",
        "    except (AttributeError, TypeError, ValueError):\n", "    except KeyError:\n",
        (T + "test_a_garbage_tokenizer_config_is_named",),
    ),
    Mutant.at(
        "hf_initial_load_traceback", "initial_load_in_hf's refusal of a bad folder is a "
        "traceback (exit 1)", "torchllm.hf.load:load_initial_weights",
        "    except (OSError, ValueError) as e:", "    except KeyError as e:",
        (T + "test_initial_load_in_hf_refuses_a_shard_outside_the_folder",),
    ),
    Mutant.at(
        "hf_folder_tokenizer_traceback", "a linked tokenizer file in initial_load_in_hf's folder "
        "is a traceback (exit 1) on the training path",
        "torchllm.checkpoint.stage.tokenizer_identity:hf_folder_tokenizer",
        "    except (OSError, ValueError) as e:", "    except KeyError as e:",
        (T + "test_initial_load_in_hf_refuses_a_linked_tokenizer_file",),
    ),
    Mutant.at(
        "export_complex_weights", "hf export writes a complex64 / int8 tensor silently",
        "torchllm.hf.export:export_hf", "    check_export_dtypes(weights, step_path)", "    pass",
        (T + "test_export_refuses_a_tensor_that_is_not_a_real_float",),
    ),
    Mutant.at(
        "export_writes_through_link", "hf export --overwrite copies into --out, writing "
        "through a link planted there", "torchllm.hf.files:replace_dir",
        "    if out.exists():\n        out.rename(old)\n",
        "    if out.exists():\n        shutil.copytree(tmp, out, dirs_exist_ok=True)\n"
        "        return\n",
        (T + "test_export_replaces_a_link_planted_in_out_never_writing_through_it",),
    ),
]
