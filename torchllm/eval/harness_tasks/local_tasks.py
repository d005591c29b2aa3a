"""Rows and prompt functions of the shipped offline lm-eval tasks (the YAML files beside this).

Each `custom_dataset` function returns the task's local copy as {"validation": Dataset}
(torchllm.eval.harness.data says where it is looked for). The Winogrande and HellaSwag prompt
functions are lm-eval's own (lm_eval/tasks/winogrande/preprocess_winogrande.py and
lm_eval/tasks/hellaswag/utils.py, MIT licence), so the local tasks score as the published ones.
"""

import functools
import re

from torchllm.eval.harness.data import local_dataset


def arc_easy(**metadata):
    return local_dataset("arc_easy", **metadata)


def piqa(**metadata):
    return local_dataset("piqa", **metadata)


def winogrande(**metadata):
    return local_dataset("winogrande", **metadata)


def hellaswag(**metadata):
    """The official rows with lm-eval's query/choices/gold added (its process_docs, run here once
    per process rather than at every docs() call, over 10,042 rows)."""
    return {"validation": _hellaswag(metadata.get("data_dir"), metadata.get("hellaswag_data"))}


# --- Winogrande: the blank filled with each option is the context; the rest is the target ------

def winogrande_doc_to_text(doc):
    answer_to_num = {"1": 0, "2": 1}
    return answer_to_num[doc["answer"]]


def winogrande_doc_to_target(doc):
    idx = doc["sentence"].index("_") + 1
    return doc["sentence"][idx:].strip()


def winogrande_doc_to_choice(doc):
    idx = doc["sentence"].index("_")
    options = [doc["option1"], doc["option2"]]
    return [doc["sentence"][:idx] + opt for opt in options]


# --- HellaSwag: lm-eval's preprocessing of the official rows ----------------------------------

def _preprocess(text):
    text = text.strip()
    # NOTE: Brackets are artifacts of the WikiHow dataset portion of HellaSwag.
    text = text.replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    text = text.replace("  ", " ")
    return text


def _process_doc(doc):
    ctx = doc["ctx_a"] + " " + doc["ctx_b"].capitalize()
    return {
        "query": _preprocess(doc["activity_label"] + ": " + ctx),
        "choices": [_preprocess(ending) for ending in doc["endings"]],
        "gold": int(doc["label"]),
    }


@functools.lru_cache(maxsize=4)
def _hellaswag(data_dir, hellaswag_data):
    """lm-eval's hellaswag process_docs (dataset.map(_process_doc)) over the local rows."""
    import datasets

    rows = local_dataset("hellaswag", data_dir, hellaswag_data)["validation"]
    return datasets.Dataset.from_list([{**doc, **_process_doc(doc)} for doc in rows])
