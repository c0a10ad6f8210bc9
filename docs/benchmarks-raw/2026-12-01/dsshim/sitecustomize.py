# Device-only: the device's torch image ships a torchvision without torchvision.io.VideoReader, which
# datasets 4.6's torch formatter imports whenever torchvision is installed. No video is read here.
try:
    import datasets.config as _c
    _c.TORCHVISION_AVAILABLE = False
except Exception:
    pass
