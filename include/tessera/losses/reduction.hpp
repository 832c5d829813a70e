// How a loss combines its per-sample (or per-element) terms, as torch.nn losses' `reduction`:
// Mean divides the sum by the number of terms, Sum does not (the gradient scales the same way).
#pragma once

namespace tessera {

enum class Reduction { Mean, Sum };

inline const char* to_string(Reduction r) { return r == Reduction::Mean ? "mean" : "sum"; }

}  // namespace tessera
