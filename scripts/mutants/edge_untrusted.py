"""Mutants of trust at the checkpoint's edges (issue 61 items 7, 8, 11, 14, 15): convert_legacy,
tensor chunks and values that name code, bounded index reads, index fields and markers past
what a checkpoint holds (tests/test_edge_untrusted.py)."""

from __future__ import annotations

from mutants.base import Mutant

T = "tests/test_edge_untrusted.py::"

MUTANTS = [
    Mutant.at(
        "convert_reseals_changed_files",
        "convert_legacy reseals a step whose chunk no longer matches its recorded CRC-32",
        "torchllm.checkpoint.convert_legacy:convert_step",
        "    if problem := check_files(step, marker):\n",
        "    if problem := None:\n",
        (T + "test_convert_legacy_refuses_a_step_whose_files_changed",),
    ),
    Mutant.at(
        "convert_unpickles_any_global",
        "convert_legacy's unpickler imports whatever global the old index names",
        "torchllm.checkpoint.legacy_pickle:_Restricted.find_class",
        "        found = self.allowed.get((module, name))\n",
        "        found = self.allowed.get((module, name)) or super().find_class(module, name)\n",
        (T + "test_convert_legacy_builds_data_only[os_system]",),
    ),
    Mutant.at(
        "convert_builds_attributes_of_a_class",
        "convert_legacy's unpickler lets BUILD set attributes on an allowed class itself",
        "torchllm.checkpoint.legacy_pickle:_Restricted.load_build",
        "        if isinstance(inst, type) or not isinstance(inst, self.classes):\n",
        "        if not isinstance(inst, (*self.classes, type)):\n",
        (T + "test_convert_legacy_builds_data_only[class_attribute]",),
    ),
    Mutant.at(
        "convert_unmarks_the_old_step",
        "convert_legacy removes the old step's marker before the new step is written",
        "torchllm.checkpoint.convert_legacy:convert_step",
        "    dcp.save(state, storage_writer=dcp_writer(str(new)), no_dist=True)",
        "    (step / MARKER).unlink()\n    dcp.save(state, storage_writer=dcp_writer(str(new)), "
        "no_dist=True)",
        (T + "test_an_interrupted_conversion_never_loses_the_step[writing]",),
    ),
    Mutant.at(
        "convert_never_finishes_a_swap",
        "a conversion stopped between its two renames is never moved in by the next run",
        "torchllm.checkpoint.convert_legacy:finish_swaps",
        "            entry.rename(step)\n",
        "            pass\n",
        (T + "test_an_interrupted_conversion_never_loses_the_step[renames]",),
    ),
    Mutant.at(
        "weight_chunk_code_falls_back",
        "a tensor chunk weights_only refuses is a read error: the resume falls back past it",
        "torchllm.checkpoint.index:StepReader.read_data",
        "        except pickle.UnpicklingError as e:\n",
        "        except KeyError as e:\n",
        (T + "test_a_weight_chunk_that_names_code_stops_the_resume",),
    ),
    Mutant.at(
        "step_load_dumps_dcp_failures",
        "Step.load lets DCP's CheckpointException (every rank's traceback) reach hf export",
        "torchllm.checkpoint.step:Step.read",
        "            if cause := untrusted_cause(e):\n",
        "            if cause := None:\n",
        (T + "test_a_weight_chunk_that_names_code_stops_the_resume",),
    ),
    Mutant.at(
        "value_refusal_quotes_weights_only_advice",
        "a refused value's line is PyTorch's first line (advice to use weights_only=False)",
        "torchllm.checkpoint.index:untrusted",
        "{what} {refused_what(error)} ",
        "{what} {str(error).splitlines()[0]} ",
        (T + "test_a_raw_pickle_value_is_refused_naming_the_global",),
    ),
    Mutant.at(
        "index_read_unbounded",
        "the index is read whole whatever COMPLETE recorded (a 3 GB sparse file: 3.4 GB read)",
        "torchllm.checkpoint.index_read:read_index",
        "max_bytes=sizes[INDEX])",
        "max_bytes=None)",
        (T + "test_an_index_is_read_no_further_than_its_recorded_size",),
    ),
    Mutant.at(
        "index_cap_ignored",
        "a COMPLETE recording a 3 GB index is believed and the file read up to it",
        "torchllm.checkpoint.index_read:read_index",
        "    if sizes[INDEX] > INDEX_CAP:\n",
        "    if False:\n",
        (T + "test_an_index_is_read_no_further_than_its_recorded_size",),
    ),
    Mutant.at(
        "zeros_called_a_pickle",
        "any index that is not JSON is called a legacy pickle and sent to convert_legacy",
        "torchllm.checkpoint.index:decode_index",
        "        if looks_like_pickle(data):",
        "        if True:",
        (T + "test_an_index_is_read_no_further_than_its_recorded_size",),
    ),
    Mutant.at(
        "nested_index_traceback",
        "an index nested 200,000 deep escapes as a RecursionError traceback",
        "torchllm.checkpoint.index:decode_index",
        "    except RecursionError:\n",
        "    except ZeroDivisionError:\n",
        (T + "test_index_fields_beyond_what_a_checkpoint_holds_are_one_line[nested]",),
    ),
    Mutant.at(
        "tensor_bytes_unchecked",
        "a tensor size of 2**40 x 2**40 in the index reaches torch.empty (an overflow traceback)",
        "torchllm.checkpoint.index_read:read_index",
        "            if need > total:\n",
        "            if False:\n",
        (T + "test_index_fields_beyond_what_a_checkpoint_holds_are_one_line[bytes]",),
    ),
    Mutant.at(
        "index_takes_quantized_dtypes",
        "a torch.qint8 weight in the index is taken (an INTERNAL ASSERT traceback)",
        "torchllm.checkpoint.index:_CONSTANTS",
        "\n              and (not isinstance(v, torch.dtype) or v in STORED_DTYPES)",
        "",
        (T + "test_index_fields_beyond_what_a_checkpoint_holds_are_one_line[qint8]",),
    ),
    Mutant.at(
        "complex_weight_resumed",
        "a complex64 weight resumes into a float32 parameter (imaginary part dropped)",
        "torchllm.checkpoint.family:family_fit",
        "    if kinds := dtype_mismatch(metadata, sds):\n",
        "    if kinds := None:\n",
        (T + "test_a_complex_weight_stops_the_resume",),
    ),
    Mutant.at(
        "nested_marker_crashes_resume",
        "a COMPLETE nested 200,000 deep crashes the resume (RecursionError) instead of falling back",
        "torchllm.checkpoint.layout:parse_marker",
        "    except RecursionError:\n",
        "    except ZeroDivisionError:\n",
        (T + "test_a_deeply_nested_marker_is_a_damaged_one",),
    ),
]
