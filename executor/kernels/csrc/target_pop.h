/* target_pop.h — end of the region opened by target_push.h. */
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
