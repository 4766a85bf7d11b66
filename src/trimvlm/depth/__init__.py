"""Layer plans (`depth=` in a recipe): which decoder blocks to skip, and in which phase (scope). Importing this
package imports every module in it (`protocol.discover`: no list kept by hand): the methods register themselves
in trimvlm.registry and the calibration rankers in `depth.calibration.RANKERS`."""

from trimvlm.protocol import discover

discover(__name__)
