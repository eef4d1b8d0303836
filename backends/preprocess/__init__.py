from backends.preprocess.pipeline import Limits, Preprocessor, plan_images
from backends.preprocess.resize_rule import ResizePlan, navit_resize

__all__ = ["Limits", "Preprocessor", "ResizePlan", "navit_resize", "plan_images"]
