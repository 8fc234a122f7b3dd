/* The tolerance test of the compiled planners, as their Python definitions make it
 * (PlannerBase.tolerated: max_load * D <= (1 + tolerance) * total, a Python int against a float, which
 * Python compares exactly). max_load * D can pass 2^63 (totals go to 2^53), so it is formed in 128
 * bits, and an integer n is <= a real x exactly when n <= floor(x). */
#ifndef MEGATRON_RAILS_WITHIN_H
#define MEGATRON_RAILS_WITHIN_H

#include <math.h>
#include <stdint.h>

/* max_load (>= 0) times D (>= 1) is at most limit (tol_limit * (double)total, as Python rounds it) */
static inline int within_limit(int64_t max_load, int64_t D, double limit) {
    if (!(limit >= 0.0)) return 0; /* negative or NaN */
    double whole = floor(limit);
    if (whole >= 0x1p126) return 1; /* above any product of two int64 */
    return (unsigned __int128)max_load * (unsigned __int128)D <= (unsigned __int128)whole;
}

#endif
