from backends.preprocess.pipeline import Limits, MediaPlan, Preprocessor, plan_media
from backends.preprocess.resize_rule import ResizePlan, navit_resize

__all__ = ["Limits", "MediaPlan", "Preprocessor", "ResizePlan", "navit_resize", "plan_media"]
