"""The batch contract: the name of every column a row or a collated batch may carry, and of every marker that rides
in a batch's dict, spelled here once. Everything else in the package (store writers, collators, row checks, the
teacher sources, the patched forward) imports the names from this module: a column renamed here is renamed
everywhere, and tools/check_layout.py refuses a known column spelled as a string literal anywhere else.

A new column goes here (its constant, a comment saying what it holds, and the tuple(s) it belongs to); a collator
that fills it lives in this package (batch/), one module per kind of rows."""

from __future__ import annotations

# ----------------------------------------------------------------------------- the student's side (Hugging Face)
INPUT_IDS = "input_ids"
ATTENTION_MASK = "attention_mask"
LABELS = "labels"
POSITION_IDS = "position_ids"  # packed rows: positions restarting at each sequence
SHIFT_LABELS = "shift_labels"  # labels already shifted by one (DataCollatorWithFlattening, sequence parallelism)

# ------------------------------------------------------------------------------- text rows (TRL's conventions)
TEXT = "text"  # a plain text row, tokenized by KDTrainer
PROMPT = "prompt"
COMPLETION = "completion"
MESSAGES = "messages"
TEACHER_PROMPT = "teacher_prompt"  # what the teacher sees instead of the prompt (privileged rows)

# ------------------------------------------------------------------- the teacher's data, one entry per position
TEACHER_TOKEN_IDS = "teacher_token_ids"  # (T, K) top-k ids (-1 on padding)
TEACHER_LOGPROBS = "teacher_logprobs"  # (T, K) their log-probs (-inf on padding)
TEACHER_SAMPLE_IDS = "teacher_sample_ids"  # (T, M) sampled teacher tokens (-1 on padding)
TEACHER_SAMPLE_COUNTS = "teacher_sample_counts"  # (T, M) how often each was drawn (0 on padding)
TEACHER_SAMPLE_LOGPROBS = "teacher_sample_logprobs"  # (T, M) their log-probs (-inf on padding)
TEACHER_SAMPLE_TEMPERATURE = "teacher_sample_temperature"  # a dataset's temperature the samples were drawn at

# ------------------------------------------------------------------ the teacher's own tokens (its prompt / tokenizer)
TEACHER_INPUT_IDS = "teacher_input_ids"
TEACHER_ATTENTION_MASK = "teacher_attention_mask"
TEACHER_LABELS = "teacher_labels"
TEACHER_POSITION_IDS = "teacher_position_ids"

# ------------------------------------------------------------------- across tokenizers (align/): the alignment
STUDENT_ALIGN_GROUPS = "student_align_groups"
TEACHER_ALIGN_GROUPS = "teacher_align_groups"
ALIGN_EXACT_OK = "align_exact_ok"

# -------------------------------------------------------------------------- several teachers: a row's routing
ROUTED_TEACHER = "teacher"  # a row's teacher: its name, or its index in the teachers' order
TEACHER_WEIGHTS = "teacher_weights"  # a row's mixture of the teachers
TEACHER_MIXTURE = "teacher_mixture"  # the collated (B, J) weights (or (B, T, J) for packed rows)

# --------------------------------------------------------------------- a served teacher's hidden states and head
TEACHER_HIDDEN_STATES = "teacher_hidden_states"  # (B, T, H) final hidden states
TEACHER_HEAD = "teacher_head"  # the served head they were computed with (teacher.serve.hidden_wire.TeacherHead)
TEACHER_WEIGHT = "teacher_weight"  # that head's weight and bias as the patched forward takes them
TEACHER_BIAS = "teacher_bias"
TEACHER_HIDDEN_SET = "teacher_hidden_set"  # several served teachers: {name: (B, T, H) states}
TEACHER_HEAD_SET = "teacher_head_set"  # and {name: its head}

# --------------------------------------------------------------------------- a rollout store's items (offline)
BEHAVIOUR_LOGPROBS = "behaviour_logprobs"  # the sampling policy's log-prob of each sampled token
TEACHER_TOKEN_LOGPROBS = "teacher_token_logprobs"  # the teacher's log-prob of each sampled token

# ------------------------------------------------------ markers: control flags riding in a batch's dict (popped)
GENERATED = "kd_generated"  # the micro-batch was generated this step (compute_loss takes kd_onpolicy_loss for it)
HAS_COMPLETION = "kd_has_completion"  # (B,) which rows came with a completion (prompt-only rows have none)
BEHAVIOUR = "kd_behaviour_logprobs"  # (B, T) label-aligned behaviour log-probs of a rollout batch
TEACHER_TOKEN = "kd_teacher_token_logprobs"  # (B, T) label-aligned teacher log-probs of a rollout batch
TOKENIZER_TEACHERS = "kd_tokenizer_teachers"  # several teachers of other tokenizers: {name: {column: tensor}}

# ------------------------------------------------------------------------------------------ groups of columns
STUDENT_COLUMNS = (INPUT_IDS, ATTENTION_MASK, LABELS, POSITION_IDS)
TOPK_COLUMNS = (TEACHER_TOKEN_IDS, TEACHER_LOGPROBS)
SAMPLE_COLUMNS = (TEACHER_SAMPLE_IDS, TEACHER_SAMPLE_COUNTS, TEACHER_SAMPLE_LOGPROBS)
TEACHER_DATA_COLUMNS = (*TOPK_COLUMNS, *SAMPLE_COLUMNS)  # a store's items: the columns TeacherDataCollator pads
OFFLINE_MARK_COLUMNS = (TEACHER_TOKEN_IDS, TEACHER_SAMPLE_IDS)  # a row with either holds its teacher's data
TEACHER_TOKEN_COLUMNS = (TEACHER_INPUT_IDS, TEACHER_ATTENTION_MASK, TEACHER_LABELS, TEACHER_POSITION_IDS)
PRIVILEGED_COLUMNS = (TEACHER_INPUT_IDS, TEACHER_LABELS)  # the dataset columns of rows with the teacher's prompt
PROMPT_COLUMNS = (PROMPT, COMPLETION, MESSAGES, TEACHER_PROMPT)
ROUTING_COLUMNS = (ROUTED_TEACHER, TEACHER_WEIGHTS)
ALIGN_COLUMNS = (STUDENT_ALIGN_GROUPS, TEACHER_ALIGN_GROUPS, ALIGN_EXACT_OK)
CROSS_TOKENIZER_COLUMNS = (
    TEACHER_INPUT_IDS, TEACHER_ATTENTION_MASK, TEACHER_LABELS, STUDENT_ALIGN_GROUPS, TEACHER_ALIGN_GROUPS,
    ALIGN_EXACT_OK, MESSAGES, PROMPT, COMPLETION, TEACHER_TOKEN_IDS, TEACHER_LOGPROBS,
)  # fmt: skip
ROLLOUT_LOGPROB_COLUMNS = {BEHAVIOUR_LOGPROBS: BEHAVIOUR, TEACHER_TOKEN_LOGPROBS: TEACHER_TOKEN}  # item -> batch key
MARKERS = (GENERATED, HAS_COMPLETION, BEHAVIOUR, TEACHER_TOKEN, TOKENIZER_TEACHERS)

# The names only this module may spell as a string literal (tools/check_layout.py): the project's own columns and
# markers. Hugging Face's and TRL's (input_ids, labels, prompt, messages, ...) and the routing column 'teacher' are
# defined above for code that wants one spelling, but common words that also mean other things are not policed, and
# the head's teacher_weight / teacher_bias are the fused losses' argument names too.
CONTRACT_NAMES = frozenset(
    {
        *TEACHER_DATA_COLUMNS, TEACHER_SAMPLE_TEMPERATURE, *TEACHER_TOKEN_COLUMNS, TEACHER_PROMPT, *ALIGN_COLUMNS,
        TEACHER_WEIGHTS, TEACHER_MIXTURE, TEACHER_HIDDEN_STATES, TEACHER_HEAD, TEACHER_HIDDEN_SET, TEACHER_HEAD_SET,
        BEHAVIOUR_LOGPROBS, TEACHER_TOKEN_LOGPROBS, *MARKERS,
    }
)  # fmt: skip
