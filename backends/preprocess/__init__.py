from backends.preprocess.media import MediaPlan, plan_media
from backends.preprocess.preprocessor import Preprocessor
from backends.preprocess.resize_rule import ResizePlan, navit_resize

__all__ = ["MediaPlan", "Preprocessor", "ResizePlan", "navit_resize", "plan_media"]
