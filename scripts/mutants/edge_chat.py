"""Mutants of the bounded chat template environment (torchllm/data/chat/bounded.py, limits.py;
issue 61 item 5): constant folding, a filter's cap, str.format, `~`, `%`, counted output, the
sum of what a render builds."""

from __future__ import annotations

from mutants.base import Mutant

T = "tests/test_chat_template_limits.py::"
DEFAULT = T + "test_an_operation_past_the_default_limit_is_refused_before_it_builds"
GROWTH = T + "test_each_way_of_growing_a_value_is_capped"

MUTANTS = [
    Mutant.at(
        "chat_template_filters_fold_at_compile_time",
        "the bounded filters take what jinja2's own take, so jinja2 folds a filter of constants "
        "when it compiles the template, outside the render's time limit",
        "torchllm.data.chat.bounded:_bounded",
        "    call.jinja_pass_arg = _PassArg.context\n",
        "    call.jinja_pass_arg = kind or _PassArg.eval_context\n",
        (T + "test_no_filter_runs_when_the_template_is_compiled",),
    ),
    Mutant.at(
        "chat_template_center_uncapped", "the center filter's width is not capped",
        "torchllm.data.chat.bounded:FILTER_GUARDS",
        '"center": _center,', '"center": None,',
        (DEFAULT + "[center]",
         T + "test_a_chat_run_whose_template_would_build_gigabytes_exits_2_at_once[center]"),
    ),
    Mutant.at(
        "chat_template_str_format_unchecked",
        "a str's format / format_map method is the plain one (no checked formatter)",
        "torchllm.data.chat.bounded:BoundedEnvironment.wrap_str_format",
        '            return self._format_method(owner, name == "format_map")\n',
        "            return None\n",
        (DEFAULT + "[str_format]", DEFAULT + "[str_format_map_nested_width]",
         GROWTH + "[str_format_repeated]"),
    ),
    Mutant.at(
        "chat_template_tilde_unchecked", "`a ~ b` joins its operands' text unchecked",
        "torchllm.data.chat.bounded:BoundedGenerator.visit_Concat",
        'self.write("environment.checked_concat(context.eval_ctx, (")',
        'self.write("str_join((")',
        (GROWTH + "[tilde]", GROWTH + "[tilde_of_a_list]"),
    ),
    Mutant.at(
        "chat_template_percent_unchecked", "the `%` operator is not intercepted (printf "
        "formatting with any width)",
        "torchllm.data.chat.bounded:BoundedEnvironment",
        'intercepted_binops = frozenset(["*", "**", "+", "%"])',
        'intercepted_binops = frozenset(["*", "**", "+"])',
        (DEFAULT + "[percent]", DEFAULT + "[percent_star_width]",
         GROWTH + "[percent_mapping]"),
    ),
    Mutant.at(
        "chat_template_output_not_counted", "`{{ }}` inside a macro or a set block is not "
        "counted toward the render's characters (a value doubles through them)",
        "torchllm.data.chat.bounded:BoundedEnvironment.counted_output",
        "        count_output(text_size(value))\n", "        text_size(value)\n",
        (GROWTH + "[set_block]", GROWTH + "[macro]"),
    ),
    Mutant.at(
        "chat_template_built_not_summed", "what a render builds is capped value by value but "
        "not in all (values kept in a loop add up to gigabytes)",
        "torchllm.data.chat.limits:count_built",
        "    if built + size > RENDER_BUILT:\n", "    if False:\n",
        (T + "test_values_kept_add_up_to_at_most_the_built_limit[list]",
         T + "test_values_kept_add_up_to_at_most_the_built_limit[str]"),
    ),
]
