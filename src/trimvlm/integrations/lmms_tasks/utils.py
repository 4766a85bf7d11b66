"""The lmms-eval functions the local-copy tasks use, imported from the installed lmms-eval (nothing redefined)."""

from lmms_eval.tasks.ai2d.utils import (  # noqa: F401
    MultiChoiceRegexFilter,
    ai2d_doc_to_target,
    ai2d_doc_to_text,
    ai2d_doc_to_visual,
)
from lmms_eval.tasks.chartqa.utils import (  # noqa: F401
    chartqa_doc_to_text,
    chartqa_doc_to_visual,
    chartqa_process_results,
)
from lmms_eval.tasks.docvqa.utils import docvqa_doc_to_text, docvqa_doc_to_visual  # noqa: F401
from lmms_eval.tasks.infovqa.utils import infovqa_doc_to_text, infovqa_doc_to_visual  # noqa: F401
from lmms_eval.tasks.pope.utils import (  # noqa: F401
    pope_aggregate_accuracy,
    pope_aggregate_f1_score,
    pope_aggregate_precision,
    pope_aggregate_recall,
    pope_aggregate_yes_ratio,
    pope_doc_to_text,
    pope_doc_to_visual,
    pope_process_results,
)
from lmms_eval.tasks.scienceqa.utils import (  # noqa: F401
    sqa_doc_to_target,
    sqa_doc_to_text,
    sqa_doc_to_visual,
    sqa_process_results,
)
from lmms_eval.tasks.textvqa.utils import (  # noqa: F401
    textvqa_doc_to_text,
    textvqa_doc_to_visual,
    textvqa_process_results,
)
