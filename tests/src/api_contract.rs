//! Checks an API answer against the OpenAPI document: the status must be
//! one the operation lists, and a JSON body must match the schema given for
//! it, with every object closed to fields the schema does not list. Every
//! answer a test reads through it is then a check that the document has not
//! drifted from the handlers.

use jsonschema::Validator;
use serde_json::{json, Map, Value};

/// The document, ready to check answers.
pub struct Contract {
    document: Value,
    /// The document's components with every object closed.
    components: Value,
}

impl Contract {
    pub fn new(document: Value) -> Self {
        let components = closed(&document["components"]);
        Self {
            document,
            components,
        }
    }

    /// The operation `method path` answers with: the path template whose
    /// segments match (`{name}` matches any one), and its operation for
    /// `method` if the document lists one.
    fn operation(&self, method: &str, path: &str) -> Option<(&str, Option<&Value>)> {
        let path = path.split('?').next().unwrap_or(path);
        let segments: Vec<&str> = path.split('/').collect();
        let paths = self.document["paths"].as_object()?;
        paths.iter().find_map(|(template, item)| {
            let pattern: Vec<&str> = template.split('/').collect();
            let matches = pattern.len() == segments.len()
                && pattern
                    .iter()
                    .zip(&segments)
                    .all(|(p, s)| p == s || (p.starts_with('{') && p.ends_with('}')));
            matches.then(|| {
                let operation = &item[method.to_ascii_lowercase()];
                (
                    template.as_str(),
                    (!operation.is_null()).then_some(operation),
                )
            })
        })
    }

    /// Panics, saying where, when the answer is not one the document gives.
    /// A path the document does not have must be a 404, and a method it
    /// does not list a 405, each with the document's error body.
    pub fn check(&self, method: &str, path: &str, status: u16, body: &Value) {
        let error = json!({"$ref": "#/components/schemas/Error"});
        let (template, schema) = match self.operation(method, path) {
            None => {
                assert_eq!(
                    status, 404,
                    "{method} {path}: no path of the document matches"
                );
                ("(no path)", &error)
            }
            Some((template, None)) => {
                assert_eq!(
                    status, 405,
                    "{method} {path}: the document lists no {method} on {template}"
                );
                (template, &error)
            }
            Some((template, Some(operation))) => {
                let response = &operation["responses"][status.to_string()];
                assert!(
                    !response.is_null(),
                    "{method} {path} answered {status}, which the document does not list for {template}: {body}"
                );
                let schema = &response["content"]["application/json"]["schema"];
                if schema.is_null() {
                    return;
                }
                (template, schema)
            }
        };
        let errors = self.errors(schema, body);
        assert!(
            errors.is_empty(),
            "{method} {path} ({status}) does not match the document's schema for {template}:\n{}\n{body:.2000}",
            errors.join("\n")
        );
    }

    /// Panics, saying where, when `value` does not match the document's
    /// schema `name` (every object closed), as an SSE event's data must
    /// match `AgentEvent` or `SessionEnded`.
    pub fn check_schema(&self, name: &str, value: &Value) {
        assert!(
            !self.components["schemas"][name].is_null(),
            "the document has no schema {name}"
        );
        let schema = json!({"$ref": format!("#/components/schemas/{name}")});
        let errors = self.errors(&schema, value);
        assert!(
            errors.is_empty(),
            "does not match the document's {name}:\n{}\n{value:.2000}",
            errors.join("\n")
        );
    }

    /// The first few places where `value` does not match `schema`.
    fn errors(&self, schema: &Value, value: &Value) -> Vec<String> {
        self.validator(schema)
            .iter_errors(value)
            .map(|err| format!("at {}: {err}", err.instance_path()))
            .take(5)
            .collect()
    }

    fn validator(&self, schema: &Value) -> Validator {
        // The answer's schema with the components beside it, where its
        // `$ref`s (`#/components/schemas/...`) point.
        let root = json!({
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "components": self.components,
            "allOf": [schema],
        });
        jsonschema::validator_for(&root)
            .unwrap_or_else(|err| panic!("the document's schema: {err}"))
    }
}

/// `value` with `"additionalProperties": false` added to every object schema
/// that lists properties and says nothing of others.
fn closed(value: &Value) -> Value {
    match value {
        Value::Object(object) => {
            let mut out: Map<String, Value> = object
                .iter()
                .map(|(key, inner)| {
                    // Property names are names, not schemas.
                    let inner = if key == "properties" {
                        match inner {
                            Value::Object(props) => Value::Object(
                                props.iter().map(|(k, v)| (k.clone(), closed(v))).collect(),
                            ),
                            other => other.clone(),
                        }
                    } else {
                        closed(inner)
                    };
                    (key.clone(), inner)
                })
                .collect();
            if out.contains_key("properties") && !out.contains_key("additionalProperties") {
                out.insert("additionalProperties".to_string(), Value::Bool(false));
            }
            Value::Object(out)
        }
        Value::Array(items) => Value::Array(items.iter().map(closed).collect()),
        other => other.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn document() -> Value {
        json!({"paths": {"/v1/things/{id}": {"get": {"responses": {
            "200": {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Thing"}}}}}}}},
            "components": {"schemas": {
                "Thing": {"type": "object", "required": ["n"], "properties": {"n": {"type": "integer"}}},
                "Error": {"type": "object", "required": ["error"], "properties": {"error": {"type": "object", "properties": {"code": {"type": "string"}, "message": {"type": "string"}}}}}}}})
    }

    #[test]
    fn an_answer_that_matches_passes() {
        Contract::new(document()).check("GET", "/v1/things/7?x=1", 200, &json!({"n": 1}));
    }

    #[test]
    #[should_panic(expected = "does not match")]
    fn a_field_the_document_does_not_list_fails() {
        Contract::new(document()).check(
            "GET",
            "/v1/things/7",
            200,
            &json!({"n": 1, "extra": true}),
        );
    }

    #[test]
    fn an_unknown_path_or_method_must_answer_the_documents_error() {
        let error = json!({"error": {"code": "not_found", "message": "no"}});
        let contract = Contract::new(document());
        contract.check("GET", "/v1/nothing", 404, &error);
        contract.check("DELETE", "/v1/things/7", 405, &error);
    }

    #[test]
    #[should_panic(expected = "does not list")]
    fn a_status_the_document_does_not_list_fails() {
        Contract::new(document()).check("GET", "/v1/things/7", 418, &json!({}));
    }

    #[test]
    #[should_panic(expected = "does not match")]
    fn a_missing_required_field_fails() {
        Contract::new(document()).check("GET", "/v1/things/7", 200, &json!({}));
    }
}
