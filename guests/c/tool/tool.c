// `c-tool`: a tool component written in C (wit-bindgen c, clang, wasi-libc).
//
// It serves the same scenarios as the Rust `echo-tool`, the Python `py-tool`
// and the JavaScript `js-tool`:
//
// - `c_echo` (read): returns its arguments;
// - `c_describe_call` (read): the call as the tool saw it, idempotency key
//   included;
// - `c_word_count` (read): counts the words of {"text": ...}, writes an
//   event, and reads the optional `greeting` config key;
// - `c_fail`: a `tool-error.execution`, recorded as `failed` without a retry;
// - `c_raise`: a `tool-error.internal`, which the host retries as the effect
//   allows.
//
// The generated bindings (`tool.h`, `tool.c`, `tool_component_type.o`) come
// from `wit-bindgen c wit --world tool`; guests/c/build.sh makes them. Every
// call runs in a fresh instance, so nothing is freed on purpose: the instance
// and its memory are dropped when the call returns.

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tool.h"

static const char *LANGUAGE = "c";
static const char *OBJECT_SCHEMA = "{\"type\":\"object\"}";
static const char *TEXT_SCHEMA =
    "{\"type\":\"object\",\"properties\":{\"text\":{\"type\":\"string\"}},\"required\":[\"text\"]}";

// A growable byte buffer for building JSON.
typedef struct {
  char *ptr;
  size_t len, cap;
} buffer_t;

static void put_n(buffer_t *b, const char *s, size_t n) {
  if (b->len + n + 1 > b->cap) {
    b->cap = (b->len + n + 1) * 2;
    b->ptr = realloc(b->ptr, b->cap);
    if (b->ptr == NULL) abort();
  }
  memcpy(b->ptr + b->len, s, n);
  b->len += n;
  b->ptr[b->len] = 0;
}

static void put(buffer_t *b, const char *s) { put_n(b, s, strlen(s)); }

// `s` as a JSON string literal.
static void put_json_string(buffer_t *b, const uint8_t *s, size_t n) {
  put(b, "\"");
  for (size_t i = 0; i < n; i++) {
    char c = (char)s[i];
    char escaped[8];
    if (c == '"' || c == '\\') {
      escaped[0] = '\\';
      escaped[1] = c;
      put_n(b, escaped, 2);
    } else if ((unsigned char)c < 0x20) {
      snprintf(escaped, sizeof escaped, "\\u%04x", (unsigned char)c);
      put(b, escaped);
    } else {
      put_n(b, &c, 1);
    }
  }
  put(b, "\"");
}

static void set_string(tool_string_t *out, const char *s) { tool_string_dup(out, s); }

static bool fail_with(tool_tool_error_t *err, uint8_t tag, const char *message) {
  err->tag = tag;
  tool_string_dup(tag == DEX_AGENTS_TYPES_TOOL_ERROR_EXECUTION ? &err->val.execution
                                                              : &err->val.internal,
                  message);
  return false;
}

static bool is_name(const tool_string_t *s, const char *name) {
  return s->len == strlen(name) && memcmp(s->ptr, name, s->len) == 0;
}

// Counts the words of the JSON string value of "text" in `json` (a minimal
// reader: the first "text" key, then its string). Returns -1 if there is none.
static long count_text_words(const uint8_t *json, size_t n) {
  const char *key = "\"text\"";
  size_t k = strlen(key);
  for (size_t i = 0; i + k <= n; i++) {
    if (memcmp(json + i, key, k) != 0) continue;
    size_t j = i + k;
    while (j < n && (json[j] == ' ' || json[j] == '\t' || json[j] == '\n' || json[j] == '\r')) j++;
    if (j >= n || json[j] != ':') return -1;
    j++;
    while (j < n && (json[j] == ' ' || json[j] == '\t' || json[j] == '\n' || json[j] == '\r')) j++;
    if (j >= n || json[j] != '"') return -1;
    long words = 0;
    bool in_word = false;
    for (j++; j < n && json[j] != '"'; j++) {
      bool space = json[j] == ' ' || json[j] == '\t';
      if (json[j] == '\\' && j + 1 < n) {
        j++;
        space = json[j] == 'n' || json[j] == 't' || json[j] == 'r';
        if (json[j] == 'u') j += 4;
      }
      if (!space && !in_word) words++;
      in_word = !space;
    }
    return j < n ? words : -1;
  }
  return -1;
}

static tool_string_t literal(const char *s) {
  tool_string_t out;
  tool_string_set(&out, s);
  return out;
}

void exports_tool_list_tools(tool_list_tool_spec_t *ret) {
  static const char *names[] = {"c_echo", "c_describe_call", "c_word_count", "c_fail", "c_raise"};
  static const char *descriptions[] = {
      "Returns its arguments.", "Returns the call as the tool saw it.",
      "Counts the words of a text.", "Fails with an error the model sees.",
      "Fails with an internal error."};
  size_t count = sizeof names / sizeof names[0];
  ret->ptr = calloc(count, sizeof(tool_tool_spec_t));
  if (ret->ptr == NULL) abort();
  ret->len = count;
  for (size_t i = 0; i < count; i++) {
    set_string(&ret->ptr[i].name, names[i]);
    set_string(&ret->ptr[i].description, descriptions[i]);
    set_string(&ret->ptr[i].parameters_schema, i == 2 ? TEXT_SCHEMA : OBJECT_SCHEMA);
    ret->ptr[i].effect.is_some = true;
    ret->ptr[i].effect.val = DEX_AGENTS_TYPES_TOOL_EFFECT_READ;
  }
}

bool exports_tool_call(tool_deferred_tool_execution_t *call, tool_string_t *ret,
                       tool_tool_error_t *err) {
  const tool_string_t *name = &call->tool_call.tool_name;
  const tool_string_t *args = &call->tool_call.arguments;
  buffer_t out = {0};
  if (is_name(name, "c_echo")) {
    tool_string_dup_n(ret, (const char *)args->ptr, args->len);
    return true;
  }
  if (is_name(name, "c_describe_call")) {
    char attempt[16];
    snprintf(attempt, sizeof attempt, "%u", call->attempt);
    put(&out, "{\"language\":\"c\",\"flow_id\":");
    put_json_string(&out, call->flow_id.ptr, call->flow_id.len);
    put(&out, ",\"turn_id\":");
    put_json_string(&out, call->turn_id.ptr, call->turn_id.len);
    put(&out, ",\"tool_call_id\":");
    put_json_string(&out, call->tool_call.tool_call_id.ptr, call->tool_call.tool_call_id.len);
    put(&out, ",\"idempotency_key\":");
    put_json_string(&out, call->idempotency_key.ptr, call->idempotency_key.len);
    put(&out, ",\"attempt\":");
    put(&out, attempt);
    put(&out, ",\"arguments\":");
    put_json_string(&out, args->ptr, args->len);
    put(&out, "}");
    ret->ptr = (uint8_t *)out.ptr;
    ret->len = out.len;
    return true;
  }
  if (is_name(name, "c_word_count")) {
    long words = count_text_words(args->ptr, args->len);
    if (words < 0) {
      return fail_with(err, DEX_AGENTS_TYPES_TOOL_ERROR_EXECUTION,
                       "expected {\"text\": \"...\"}");
    }
    dex_agents_step_heartbeat();
    char counted[64];
    snprintf(counted, sizeof counted, "{\"words\":%ld}", words);
    tool_string_t event_type = literal("c_word_count.counted");
    tool_string_t payload = literal(counted);
    dex_agents_events_write_event(&event_type, &payload);
    tool_string_t key = literal("greeting");
    tool_string_t greeting;
    snprintf(counted, sizeof counted, "{\"words\":%ld", words);
    put(&out, counted);
    if (dex_agents_config_get(&key, &greeting)) {
      put(&out, ",\"greeting\":");
      put_json_string(&out, greeting.ptr, greeting.len);
    }
    put(&out, "}");
    ret->ptr = (uint8_t *)out.ptr;
    ret->len = out.len;
    return true;
  }
  if (is_name(name, "c_fail")) {
    put(&out, LANGUAGE);
    put(&out, "-tool refused: ");
    put_n(&out, (const char *)args->ptr, args->len);
    return fail_with(err, DEX_AGENTS_TYPES_TOOL_ERROR_EXECUTION, out.ptr);
  }
  if (is_name(name, "c_raise")) {
    return fail_with(err, DEX_AGENTS_TYPES_TOOL_ERROR_INTERNAL,
                     "c-tool failed internally on purpose");
  }
  put(&out, "c-tool serves no tool ");
  put_json_string(&out, name->ptr, name->len);
  return fail_with(err, DEX_AGENTS_TYPES_TOOL_ERROR_EXECUTION, out.ptr);
}
