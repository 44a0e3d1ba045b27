/* target_push.h — compile the functions that follow for HELM_TARGET (e.g. "avx2,fma,f16c"),
 * whatever the unit's base flags: the per-unit equivalent of __attribute__((target(...))).
 * _Pragma through two macro levels so that HELM_TARGET is expanded before stringizing. */
#define HELM_PRAGMA_(x) _Pragma(#x)
#define HELM_PRAGMA(x) HELM_PRAGMA_(x)
#if defined(__clang__)
HELM_PRAGMA(clang attribute push(__attribute__((target(HELM_TARGET))), apply_to = function))
#else
#pragma GCC push_options
HELM_PRAGMA(GCC target(HELM_TARGET))
#endif
